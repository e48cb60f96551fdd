"""The vLLM worker extension and its HTTP client, against stand-ins (vLLM cannot run here): a
worker whose model records what ``load_weights`` receives, ranks that vote through threads, and
a real local HTTP server answering ``vllm serve``'s endpoints (tests/integrations/conftest.py)."""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import urllib.parse

import pytest
import torch

import deltastore.read.subscriber as subscriber_module
from deltastore import Publisher
from deltastore.errors import EngineUpdateError, SelectionError
from deltastore.integrations.hostcopy import HostCopy, ServedVersion, agree_over
from deltastore.layout.select import Selection
from deltastore.integrations.vllm import GROUP_GETTERS, VLLMServerSync
from deltastore.write.policy import WriterPolicy

#: A test never waits longer than this for the follow thread.
DEADLINE_S = 60.0


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(32, 8, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
            "model.norm.weight": torch.randn(8, generator=g)}


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in state.items()}


def _changed(state: dict[str, torch.Tensor], **edits: float) -> dict[str, torch.Tensor]:
    """A copy of ``state`` with element 0 of each named tensor (dots as '__') set."""
    out = {n: t.clone() for n, t in state.items()}
    for key, value in edits.items():
        out[key.replace("__", ".")].view(-1)[0] = value
    return out


def _wait_staged(w, version: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        st = w.deltastore_status()
        assert st["error"] is None, st["error"]
        if st["staged"] is not None and st["staged"]["version"] >= version:
            return
        assert time.monotonic() < deadline, f"version {version} was not staged: {st}"
        time.sleep(0.02)


def _publisher(url: str) -> Publisher:
    return Publisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1))


def test_worker_follows_and_reloads_only_changed_tensors(tmp_path, vllm_parts) -> None:
    url = str(tmp_path / "store")
    v1 = _state(0)
    model = vllm_parts.RecordingModel(_shapes(v1))
    w = vllm_parts.Worker(model)
    with pytest.raises(RuntimeError, match="deltastore_start"):
        w.deltastore_sync()
    with _publisher(url) as pub:
        pub.publish(v1, step=10, metadata={"model_version": 1})
        w.deltastore_start(url, interval=0.02, threads=1, wait_s=DEADLINE_S)
        assert w.deltastore_start(url)["staged"]["version"] == 1  # idempotent
        with pytest.raises(ValueError):
            w.deltastore_start(url + "-other")
        assert w.deltastore_version() is None and model.calls == []  # nothing loaded before a sync
        served = w.deltastore_sync()
        assert served["version"] == 1 and served["model_version"] == 1 and served["step"] == 10
        assert sorted(model.calls[-1]) == sorted(v1)  # the first version: every tensor
        assert model.holds(v1)
        assert w.deltastore_sync() == served and len(model.calls) == 1  # nothing new: no reload

        v2 = _changed(v1, model__norm__weight=5.0)
        pub.publish(v2, step=11, metadata={"model_version": 2})
        _wait_staged(w, 2)
        # Staged on the host while the engine serves: the engine's model is untouched until the sync.
        assert w.deltastore_version()["version"] == 1 and len(model.calls) == 1
        assert model.holds(v1)
        served = w.deltastore_sync()
        assert served["model_version"] == 2 and model.calls[-1] == ["model.norm.weight"]
        assert model.holds(v2)

        # Two versions between syncs: one reload of the union of what they changed.
        v3 = _changed(v2, model__layers__0__mlp__up_proj__weight=-1.0)
        pub.publish(v3, metadata={"model_version": 3})
        v4 = _changed(v3, model__embed_tokens__weight=0.25)
        pub.publish(v4, metadata={"model_version": 4})
        _wait_staged(w, 4)
        served = w.deltastore_sync()
        assert served["version"] == 4 and served["model_version"] == 4
        assert sorted(model.calls[-1]) == ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
        assert model.holds(v4)
    # load_weights ran only in the RPC's thread (vLLM runs it between engine steps), never in
    # the follow thread.
    assert model.threads == {threading.get_ident()}
    w.deltastore_stop()
    w.deltastore_stop()  # idempotent
    with pytest.raises(RuntimeError):
        w.deltastore_version()


def test_follow_failure_is_reported_by_the_next_rpc(tmp_path, vllm_parts) -> None:
    url = str(tmp_path / "store")
    v1 = _state(0)
    model = vllm_parts.RecordingModel(_shapes(v1))
    w = vllm_parts.Worker(model)
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
    assert model.holds(v1)  # the engine keeps serving the last good version
    w.deltastore_stop()


def test_start_on_an_empty_store_waits_and_sync_never_blocks_the_engine(tmp_path, vllm_parts) -> None:
    url = str(tmp_path / "store")
    v1 = _state(3)
    model = vllm_parts.RecordingModel(_shapes(v1))
    w = vllm_parts.Worker(model)
    with Publisher(url, writer_policy=WriterPolicy(threads=1)) as pub:
        pub.publish(v1)  # creates the store; the worker starts before the version it follows
        v2 = _changed(v1, model__norm__weight=9.0)
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
        assert model.holds(v2)
    w.deltastore_stop()


def test_start_before_the_first_version(tmp_path, vllm_parts) -> None:
    store = tmp_path / "store"
    v1 = _state(4)
    model = vllm_parts.RecordingModel(_shapes(v1))
    w = vllm_parts.Worker(model)
    with Publisher(str(store), writer_policy=WriterPolicy(threads=1)) as pub:  # an empty store: HEAD at version 0
        w.deltastore_start(str(store), interval=0.02, threads=1)
        time.sleep(0.2)
        st = w.deltastore_status()
        assert st["error"] is None and st["staged"] is None
        assert w.deltastore_sync() is None  # nothing to serve yet
        pub.publish(v1)
        _wait_staged(w, 1)
    assert w.deltastore_sync()["version"] == 1
    assert model.holds(v1)
    w.deltastore_stop()


def test_a_failed_load_puts_the_served_version_back(tmp_path, vllm_parts) -> None:
    url = str(tmp_path / "store")
    v1 = _state(5)
    v2 = _changed(v1, model__norm__weight=7.0, model__layers__0__mlp__up_proj__weight=-3.0)
    model = vllm_parts.RecordingModel(_shapes(v1))
    w = vllm_parts.Worker(model)
    with _publisher(url) as pub:
        pub.publish(v1, metadata={"model_version": 1})
        w.deltastore_start(url, interval=0.02, threads=1, wait_s=DEADLINE_S)
        w.deltastore_sync()
        pub.publish(v2, metadata={"model_version": 2})
        _wait_staged(w, 2)
        model.fail_after = 1  # the engine takes one of the two changed tensors, then fails
        with pytest.raises(EngineUpdateError, match="put back at version 1"):
            w.deltastore_sync()
        assert len(model.calls[-2]) == 1  # the failed call did write a tensor of version 2 ...
        assert sorted(model.calls[-1]) == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
        assert model.holds(v1)  # ... and the sync put version 1's bits back, from the store
        assert w.deltastore_version()["version"] == 1
        assert w.deltastore_status()["pending_tensors"] == 2  # kept for the next try
        assert w.deltastore_sync()["version"] == 2
        assert model.holds(v2)

        # A first load cannot be undone: the state is unknown, and the next sync loads everything.
        fresh = vllm_parts.RecordingModel(_shapes(v1))
        w2 = vllm_parts.Worker(fresh)
        w2.deltastore_start(url, interval=0.02, threads=1, wait_s=DEADLINE_S)
        fresh.fail_after = 2
        with pytest.raises(EngineUpdateError, match="state is unknown"):
            w2.deltastore_sync()
        assert w2.deltastore_version() is None and w2.deltastore_status()["engine_state_unknown"]
        assert w2.deltastore_sync()["version"] == 2
        assert sorted(fresh.calls[-1]) == sorted(v1) and fresh.holds(v2)
        assert not w2.deltastore_status()["engine_state_unknown"]
    w.deltastore_stop()
    w2.deltastore_stop()


def _tp_ranks(vllm_parts, v1: dict[str, torch.Tensor], world: int = 2) -> tuple[list, list]:
    """``world`` tensor-parallel ranks voting through threads, each with a model of ``v1``'s
    shapes that records its loads."""
    group = vllm_parts.ThreadGroup(world)
    models = [vllm_parts.RecordingModel(_shapes(v1)) for _ in range(world)]
    return models, [vllm_parts.Worker(m, group, r) for r, m in enumerate(models)]


def test_ranks_swap_the_same_version_or_none(tmp_path, vllm_parts) -> None:
    """Two tensor-parallel ranks, each following the store: a rank busy with its host copy, or
    a rank whose load fails, keeps both ranks at the version they served."""
    url = str(tmp_path / "store")
    v1 = _state(6)
    models, ranks = _tp_ranks(vllm_parts, v1)
    sync = vllm_parts.on_all_ranks
    with _publisher(url) as pub:
        pub.publish(v1, metadata={"model_version": 1})
        sync(ranks, "deltastore_start", url, interval=0.02, threads=1, wait_s=DEADLINE_S)
        assert [r["version"] for r in sync(ranks, "deltastore_sync")] == [1, 1]
        v2 = _changed(v1, model__norm__weight=2.5)
        pub.publish(v2, metadata={"model_version": 2})
        for w in ranks:
            _wait_staged(w, 2)
        with ranks[1]._deltastore.lock:  # rank 1's follow thread is writing its host copy
            assert [r["version"] for r in sync(ranks, "deltastore_sync")] == [1, 1]
        assert [len(m.calls) for m in models] == [1, 1] and all(m.holds(v1) for m in models)

        models[1].fail_after = 0  # rank 1's load fails: rank 0, which loaded, puts version 1 back too
        with pytest.raises(EngineUpdateError):
            sync(ranks, "deltastore_sync")
        assert [w.deltastore_version()["version"] for w in ranks] == [1, 1]
        assert all(m.holds(v1) for m in models)
        assert models[0].calls[-2] == ["model.norm.weight"] == models[0].calls[-1]  # loaded, then restored
        assert [r["version"] for r in sync(ranks, "deltastore_sync")] == [2, 2]
        assert all(m.holds(v2) for m in models)
    sync(ranks, "deltastore_stop")


def test_tensor_parallel_ranks_share_one_host_copy(tmp_path, vllm_parts) -> None:
    """Two tensor-parallel ranks started with shared_host_copy: one follows the store, the other
    fetches nothing; both load every version, and a failed load on one puts both back."""
    url = str(tmp_path / "store")
    copy = tmp_path / "node-copy"
    v1 = _state(8)
    models, ranks = _tp_ranks(vllm_parts, v1)
    sync = vllm_parts.on_all_ranks
    with _publisher(url) as pub:
        pub.publish(v1, metadata={"model_version": 1})
        sync(ranks, "deltastore_start", url, interval=0.02, threads=1, wait_s=DEADLINE_S, shared_host_copy=str(copy))
        assert sorted(w.deltastore_status()["shared"]["leader"] for w in ranks) == [False, True]
        assert [r["version"] for r in sync(ranks, "deltastore_sync", block=True)] == [1, 1]
        v2 = _changed(v1, model__norm__weight=2.5)
        pub.publish(v2, metadata={"model_version": 2})
        for w in ranks:
            _wait_staged(w, 2)
        models[1].fail_after = 0
        with pytest.raises(EngineUpdateError):
            sync(ranks, "deltastore_sync", block=True)
        assert all(m.holds(v1) for m in models)
        assert [r["version"] for r in sync(ranks, "deltastore_sync", block=True)] == [2, 2]
        assert all(m.holds(v2) and m.calls[-1] == ["model.norm.weight"] for m in models)
        fetched = sorted(w._deltastore.sub.bytes_fetched for w in ranks)
        assert fetched[0] == 0 < fetched[1]  # only the leader follows the store (restores read apart)
        assert len(list(copy.glob("weights.*.bin"))) == 1
    sync(ranks, "deltastore_stop")
    assert not copy.exists()


#: vllm/model_executor/models/utils.py (vllm-project/vllm @ d30d0c133c3f47a6436788f82398b21eb23df8c0):
#: ``get_pp_missing_layer_names(model) -> list[str]``, the names of the model's PPMissingLayer
#: modules (the layers of the other pipeline stages), each with a trailing dot; the models'
#: ``load_weights`` skip a checkpoint name that starts with one (``is_pp_missing_parameter``).
VLLM_PP_MISSING = "vllm.model_executor.models.utils"


def _stand_in_pp_missing(monkeypatch) -> None:
    """vLLM's ``get_pp_missing_layer_names`` on a stand-in model: its ``missing`` prefixes."""
    import types

    mod = types.ModuleType(VLLM_PP_MISSING)
    mod.get_pp_missing_layer_names = lambda model: list(model.missing)
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.models"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, VLLM_PP_MISSING, mod)


def test_pipeline_stages_hold_and_load_only_their_layers(tmp_path, vllm_parts, monkeypatch) -> None:
    """Two pipeline-parallel ranks started with pipeline_stage=True: each host copy holds only
    its stage's tensors (a rank's model would refuse another stage's tensor), and each sync
    loads the stage's changed tensors only, both ranks at one version."""
    _stand_in_pp_missing(monkeypatch)
    url = str(tmp_path / "store")
    g = torch.Generator().manual_seed(4)
    v1 = {n: torch.randn(*shape, generator=g) for n, shape in [
        ("model.embed_tokens.weight", (32, 8)), ("model.layers.0.self_attn.q_proj.weight", (8, 8)),
        ("model.layers.0.mlp.up_proj.weight", (16, 8)), ("model.layers.1.self_attn.q_proj.weight", (8, 8)),
        ("model.layers.1.mlp.up_proj.weight", (16, 8)), ("model.layers.10.mlp.up_proj.weight", (16, 8)),
        ("model.norm.weight", (8,)), ("lm_head.weight", (32, 8))]}
    # rank 0: embeddings and layer 0; rank 1: layers 1 and 10, the final norm and lm_head
    missing = [["model.layers.1.", "model.layers.10.", "model.norm.", "lm_head."], ["model.embed_tokens.", "model.layers.0."]]
    stages = [{n for n in v1 if not any(n.startswith(p) for p in m)} for m in missing]
    assert stages[0] == {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.mlp.up_proj.weight"}  # "model.layers.1." is not a prefix of layer 10
    models = []
    for m, stage in zip(missing, stages):
        model = vllm_parts.RecordingModel({n: tuple(v1[n].shape) for n in stage})  # KeyError on another stage's tensor
        model.missing = m
        models.append(model)
    group = vllm_parts.ThreadGroup(2)
    ranks = [vllm_parts.Worker(m, group, r) for r, m in enumerate(models)]
    sync = vllm_parts.on_all_ranks
    with _publisher(url) as pub:
        pub.publish(v1)
        sync(ranks, "deltastore_start", url, interval=0.02, threads=1, wait_s=DEADLINE_S, pipeline_stage=True)
        for w, stage in zip(ranks, stages):
            assert set(w._deltastore.weights) == stage  # the host copy holds the stage only
        assert [r["version"] for r in sync(ranks, "deltastore_sync")] == [1, 1]
        for m, stage in zip(models, stages):
            assert m.holds({n: v1[n] for n in stage}) and sorted(m.calls[0]) == sorted(stage)
        v2 = _changed(v1, model__layers__0__mlp__up_proj__weight=1.5, model__layers__10__mlp__up_proj__weight=2.5)
        pub.publish(v2)
        for w in ranks:
            _wait_staged(w, 2)
        assert [r["version"] for r in sync(ranks, "deltastore_sync")] == [2, 2]
        assert models[0].calls[-1] == ["model.layers.0.mlp.up_proj.weight"]
        assert models[1].calls[-1] == ["model.layers.10.mlp.up_proj.weight"]
        for m, stage in zip(models, stages):
            assert m.holds({n: v2[n] for n in stage})
        # every tensor of rank 1's stage changes and its load fails partway: both ranks put
        # version 2 back, rank 1 rebuilding its whole stage from the store (its selection)
        v3 = _changed(v2, model__layers__0__mlp__up_proj__weight=3.5, model__layers__1__self_attn__q_proj__weight=3.5,
                      model__layers__1__mlp__up_proj__weight=3.5, model__layers__10__mlp__up_proj__weight=3.5,
                      model__norm__weight=3.5, lm_head__weight=3.5)
        pub.publish(v3)
        for w in ranks:
            _wait_staged(w, 3)
        opened = []
        real = subscriber_module.Subscriber
        monkeypatch.setattr(subscriber_module, "Subscriber",
                            lambda *a, **k: opened.append(k.get("select")) or real(*a, **k))
        models[1].fail_after = 2
        with pytest.raises(EngineUpdateError):
            sync(ranks, "deltastore_sync")
        monkeypatch.setattr(subscriber_module, "Subscriber", real)
        assert ranks[1]._deltastore.sub.select in opened  # the rebuild pulled the stage, not the model
        assert [w.deltastore_version()["version"] for w in ranks] == [2, 2]
        assert sorted(models[1].calls[-1]) == sorted(stages[1])  # restored whole, from the stage's pull
        for m, stage in zip(models, stages):
            assert m.holds({n: v2[n] for n in stage})
        assert [r["version"] for r in sync(ranks, "deltastore_sync")] == [3, 3]
        for m, stage in zip(models, stages):
            assert m.holds({n: v3[n] for n in stage})
    sync(ranks, "deltastore_stop")
    with pytest.raises(SelectionError, match="whole tensors"):  # the engines' loaders cut shards themselves
        HostCopy(url, select=Selection(shard=(0, 0, 2)))


def test_agree_over_connects_every_rank(vllm_parts) -> None:
    """Four ranks, TP groups {0,1},{2,3} and PP groups {0,2},{1,3}, voting in threads: the
    answer is the same on every rank, and yes only when all four votes are equal."""
    def run(votes: list[str]) -> list[bool]:
        tp = [vllm_parts.ThreadGroup(2), vllm_parts.ThreadGroup(2)]
        pp = [vllm_parts.ThreadGroup(2), vllm_parts.ThreadGroup(2)]
        answers: list[bool | None] = [None] * 4

        def rank(r: int) -> None:
            gathers = [functools.partial(tp[r // 2].gather, r % 2), functools.partial(pp[r % 2].gather, r // 2)]
            answers[r] = agree_over(votes[r], gathers)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return answers

    assert run(["a", "a", "a", "a"]) == [True] * 4
    assert run(["a", "a", "a", "b"]) == [False] * 4
    assert run(["a", "a", "b", "b"]) == [False] * 4  # each TP group agrees, the pipeline does not


def test_server_sync_drives_the_extension_over_http(tmp_path, vllm_parts, vllm_server) -> None:
    url = str(tmp_path / "store")
    v1 = _state(7)
    model = vllm_parts.RecordingModel(_shapes(v1))
    server = vllm_server([vllm_parts.Worker(model)])
    engine = VLLMServerSync(server.url, url, interval=0.02, threads=1)
    with pytest.raises(EngineUpdateError, match="deltastore_start"):
        engine.sync()  # not started: the worker's RuntimeError comes back as HTTP 500
    with _publisher(url) as pub:
        pub.publish(v1, step=1, metadata={"model_version": 1})
        assert engine.start(wait_s=DEADLINE_S)[0]["staged"]["version"] == 1
        server.calls.clear()
        served = engine.sync()
        assert served == ServedVersion(1, 1, 1, served.manifest) and engine.served == served and model.holds(v1)
        # After a swap: the prefix cache is reset, and the engine's weight version names the version.
        assert server.paths() == ["/collective_rpc", "/reset_prefix_cache", "/update_weight_version"]
        assert server.weight_version == "1" == engine.weight_version()
        server.calls.clear()
        assert engine.sync() == served and server.paths() == ["/collective_rpc"]  # nothing new: one RPC

        v2 = _changed(v1, model__norm__weight=4.0)
        pub.publish(v2, step=2, metadata={"model_version": 2})
        _wait_staged(server.workers[0], 2)
        drained = VLLMServerSync(server.url, url, drain=True)
        server.calls.clear()
        assert drained.sync().version == 2 and model.holds(v2)
        # Drained: in-flight requests finish first; the swap, reset and tag happen while paused.
        assert [urllib.parse.urlparse(p).path for p in server.paths()] == [
            "/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]
        assert server.calls[0][1] == "/pause?mode=wait" and not server.paused
        assert server.calls[1][2] == {"method": "deltastore_sync", "args": [], "kwargs": {"block": True}}
    engine.close()
    assert server.workers[0]._deltastore is None


def test_server_without_the_weight_version_endpoint(tmp_path, vllm_parts, vllm_server, caplog) -> None:
    """An older vLLM without /update_weight_version: one warning, then the client stops asking."""
    url = str(tmp_path / "store")
    v1 = _state(8)
    server = vllm_server([vllm_parts.Worker(vllm_parts.RecordingModel(_shapes(v1)))], missing=("/update_weight_version",))
    engine = VLLMServerSync(server.url, url, interval=0.02, threads=1)
    with _publisher(url) as pub:
        pub.publish(v1)
        engine.start(wait_s=DEADLINE_S)
        with caplog.at_level(logging.WARNING, logger="deltastore.integrations.vllm"):
            assert engine.sync().version == 1
        assert "has no /update_weight_version" in caplog.text
        pub.publish(_changed(v1, model__norm__weight=1.5))
        _wait_staged(server.workers[0], 2)
        server.calls.clear()
        assert engine.sync().version == 2
        assert server.paths() == ["/collective_rpc", "/reset_prefix_cache"]
    engine.close()


# --- the stand-ins against vLLM's source ----------------------------------------------------

#: Where each endpoint the client calls was read (vllm-project/vllm, file @ commit), with the
#: request and reply it takes there.
VLLM_SOURCES = {
    # body {"method", "args", "kwargs", "timeout"}; reply {"results": [one per worker]}, dicts
    # and None passed through, anything else str(); only with VLLM_SERVER_DEV_MODE.
    ("POST", "/collective_rpc"): "vllm/entrypoints/serve/rpc/api_router.py@09cb327f1183534adbdf9eee3e438688e75fbe2b",
    # query reset_running_requests, reset_external; empty 200; only with VLLM_SERVER_DEV_MODE.
    ("POST", "/reset_prefix_cache"): "vllm/entrypoints/serve/cache/api_router.py@09cb327f1183534adbdf9eee3e438688e75fbe2b",
    # body {"new_version": str} (Body(embed=True)) -> EngineClient.update_weight_version(new_version)
    ("POST", "/update_weight_version"): "vllm/entrypoints/serve/dev/rlhf/api_router.py@0100a2129224e729af1b3b8ed42a900cdfe9a452",
    # reply {"weight_version": EngineClient.get_weight_version()}
    ("GET", "/weight_info"): "vllm/entrypoints/serve/dev/rlhf/api_router.py@0100a2129224e729af1b3b8ed42a900cdfe9a452",
    # query mode in abort|wait|keep ("wait": finish the requests in flight), clear_cache
    ("POST", "/pause"): "vllm/entrypoints/serve/dev/rlhf/api_router.py@0100a2129224e729af1b3b8ed42a900cdfe9a452",
    ("POST", "/resume"): "vllm/entrypoints/serve/dev/rlhf/api_router.py@0100a2129224e729af1b3b8ed42a900cdfe9a452",
}
#: The request fields each endpoint reads there.
VLLM_BODY_FIELDS = {"/collective_rpc": {"method", "args", "kwargs", "timeout"}, "/update_weight_version": {"new_version"}}
VLLM_PAUSE_MODES = {"abort", "wait", "keep"}  # vllm.v1.engine.PauseMode, same file
#: vllm/distributed/parallel_state.py (vllm-project/vllm): get_tp_group() / get_pp_group() return a
#: GroupCoordinator with .world_size and .cpu_group (gloo); they assert when not initialized.
VLLM_GROUP_GETTERS = ("get_tp_group", "get_pp_group")


def test_stand_in_serves_what_vllm_serves(tmp_path, vllm_parts, vllm_server) -> None:
    assert set(VLLM_SOURCES) == vllm_parts.VLLM_ENDPOINTS
    # Every request the client sends is one of those, with the fields vLLM reads.
    url = str(tmp_path / "store")
    v1 = _state(9)
    server = vllm_server([vllm_parts.Worker(vllm_parts.RecordingModel(_shapes(v1)))])
    with _publisher(url) as pub:
        pub.publish(v1)
        engine = VLLMServerSync(server.url, url, interval=0.02, threads=1, drain=True)
        engine.start(wait_s=DEADLINE_S)
        engine.sync()
        engine.weight_version()
        engine.close()
    for method, path, body in server.calls:
        u = urllib.parse.urlparse(path)
        assert (method, u.path) in vllm_parts.VLLM_ENDPOINTS, path
        if u.path in VLLM_BODY_FIELDS:
            assert set(body) <= VLLM_BODY_FIELDS[u.path], (path, body)
        if u.path == "/pause":
            assert urllib.parse.parse_qs(u.query)["mode"][0] in VLLM_PAUSE_MODES
    assert VLLM_GROUP_GETTERS == GROUP_GETTERS  # the groups the ranks vote over
