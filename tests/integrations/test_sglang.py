"""The SGLang integration against stand-ins (SGLang cannot run here): an in-process engine object
with ``Engine.update_weights_from_tensor``'s signature, and a real local HTTP server answering
``sglang.launch_server``'s weight-update endpoints, loading the safetensors files it is pointed at.
Both record every call, and fail a chosen call partway (after taking some of its tensors)."""

from __future__ import annotations

import http.server
import inspect
import json
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import torch

from deltastore import Publisher
from deltastore.errors import EngineUpdateError
from deltastore.integrations.hostcopy import ServedVersion
from deltastore.integrations.sglang import EngineApplier, ServerApplier, SGLangSync, buckets
from deltastore.write.policy import WriterPolicy
from testkit.servers import http_server

DEADLINE_S = 60.0
#: Each tensor of _state is 256 bytes in bf16 (128 elements): a bucket of 300 bytes holds one.
ONE_TENSOR = 300

# --- what SGLang's source says (sgl-project/sglang, file @ commit) ---------------------------

#: python/sglang/srt/entrypoints/engine.py @ 001067fffe33427bee0ed2f007fb7551a1d76b44:
#: ``def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True)``,
#: returning the tokenizer manager's ``(success, message)``.
ENGINE_UPDATE_PARAMS = {"named_tensors": inspect.Parameter.empty, "load_format": None, "flush_cache": True}
#: python/sglang/srt/managers/io_struct.py @ 001067fffe33427bee0ed2f007fb7551a1d76b44:
#: ``UpdateWeightFromDiskReqInput`` and ``UpdateWeightVersionReqInput`` (whose
#: ``abort_all_requests`` defaults to True there: the client must send False).
DISK_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
               "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"}
VERSION_FIELDS = {"new_version", "abort_all_requests"}
#: python/sglang/srt/entrypoints/http_server.py @ 0025436eab0556737d615b36a4dd3e1e26e82f3d: the
#: routes; update_weights_from_disk answers {"success", "message", "num_paused_requests"} with
#: 200, or 400 when not successful, and sets the weight version only on success.
SGLANG_ENDPOINTS = {("POST", "/update_weights_from_disk"), ("POST", "/update_weight_version"),
                    ("GET", "/get_weight_version")}


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(16, 8, generator=g) for i in range(4)}


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in state.items()}


def _changed(state: dict[str, torch.Tensor], layers: list[int], value: float) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    for i in layers:
        out[f"model.layers.{i}.mlp.up_proj.weight"][0, 0] = value
    return out


def _holds(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    return set(params) >= set(state) and all(torch.equal(params[n], t.to(torch.bfloat16)) for n, t in state.items())


def _wait_staged(sync: SGLangSync, version: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while (st := sync.status())["staged"] is None or st["staged"]["version"] < version:
        assert st["error"] is None and time.monotonic() < deadline, st
        time.sleep(0.02)


def _publisher(url: str) -> Publisher:
    return Publisher(url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1))


class FakeEngine:
    """``sglang.Engine``'s update method, recording calls and copying into its parameters.

    ``fail_call``: the call with this number (1-based, over the engine's life) takes
    ``fail_after`` of its tensors, then fails: ``(False, message)``, or raises if ``raises``."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.calls: list[dict[str, Any]] = []
        self.fail_call: int | None = None
        self.fail_after = 0
        self.raises = False

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append({"names": [n for n, _ in named_tensors], "flush_cache": flush_cache,
                           "load_format": load_format, "ptrs": [t.data_ptr() for _, t in named_tensors]})
        for i, (n, t) in enumerate(named_tensors):
            if len(self.calls) == self.fail_call and i == self.fail_after:
                if self.raises:
                    raise RuntimeError("stand-in scheduler crashed")
                return False, "stand-in refused the update"
            self.params[n] = t.clone()
        return True, "Success"


def test_engine_applier_swaps_changed_tensors_in_buckets(tmp_path) -> None:
    url = str(tmp_path / "store")
    engine = FakeEngine()
    sync = SGLangSync(EngineApplier(engine, bucket_bytes=2 * ONE_TENSOR), url, interval=0.02, threads=1)
    v1 = _state(0)
    with _publisher(url) as pub:
        pub.publish(v1, step=1, metadata={"model_version": 1})
        sync.start(wait_s=DEADLINE_S)
        assert sync.sync() == ServedVersion(1, 1, 1, sync.served.manifest) and _holds(engine.params, v1)
        # Four tensors, two per call; only the last call flushes the prefix cache.
        assert [len(c["names"]) for c in engine.calls] == [2, 2]
        assert [c["flush_cache"] for c in engine.calls] == [False, True]
        assert all(c["load_format"] is None for c in engine.calls)
        host = {t.data_ptr() for t in sync.host.weights.values()}
        assert not host & {p for c in engine.calls for p in c["ptrs"]}  # copies, never the host copy
        v2 = _changed(v1, [2], 3.0)
        pub.publish(v2, step=2, metadata={"model_version": 2})
        _wait_staged(sync, 2)
        assert sync.sync().model_version == 2 and _holds(engine.params, v2)
        assert engine.calls[-1]["names"] == ["model.layers.2.mlp.up_proj.weight"]  # only what changed
        assert engine.calls[-1]["flush_cache"] is True
        assert sync.sync().version == 2 and len(engine.calls) == 3  # nothing new: no call
    sync.close()


@pytest.mark.parametrize("raises", [False, True], ids=["success-false", "raises"])
def test_engine_failing_on_the_second_call_keeps_the_old_version(tmp_path, raises) -> None:
    url = str(tmp_path / "store")
    engine = FakeEngine()
    sync = SGLangSync(EngineApplier(engine, bucket_bytes=ONE_TENSOR), url, interval=0.02, threads=1)
    v1 = _state(1)
    with _publisher(url) as pub:
        pub.publish(v1, metadata={"model_version": 1})
        sync.start(wait_s=DEADLINE_S)
        sync.sync()
        v2 = _changed(v1, [0, 1, 3], -2.0)
        pub.publish(v2, metadata={"model_version": 2})
        _wait_staged(sync, 2)
        engine.fail_call, engine.raises = len(engine.calls) + 2, raises  # the second call of the next sync
        with pytest.raises(EngineUpdateError, match="put back at version 1") as err:
            sync.sync()
        assert ("crashed" if raises else "refused") in str(err.value)
        # Call 1 took layer 0 at version 2, call 2 failed; then every tensor of the sync was sent
        # again at version 1, rebuilt from the store, flushing the prefix cache at the end.
        restore = engine.calls[-3:]
        assert [c["names"] for c in restore] == [[f"model.layers.{i}.mlp.up_proj.weight"] for i in (0, 1, 3)]
        assert restore[-1]["flush_cache"] is True
        assert _holds(engine.params, v1) and sync.served.version == 1
        assert sync.sync().version == 2 and _holds(engine.params, v2)  # the next sync tries again
    sync.close()


def test_a_replaced_history_is_not_put_back_as_the_version_served(tmp_path) -> None:
    """The store's history is replaced under a served version: a failed swap cannot rebuild that
    version (its number now names other weights), so the state is reported unknown, never
    "put back"; the next sync loads the new history whole."""
    url = str(tmp_path / "store")
    engine = FakeEngine()
    sync = SGLangSync(EngineApplier(engine, bucket_bytes=None), url, interval=0.02, threads=1)
    with _publisher(url) as pub:
        pub.publish(_state(7))
    sync.start(wait_s=DEADLINE_S)
    served = sync.sync()
    # Another run publishes under the same URL (moved away in one step: the follower keeps
    # writing its heartbeat into the store meanwhile).
    (tmp_path / "store").rename(tmp_path / "old-run")
    b1 = _state(8)
    b2 = _changed(b1, [0], 1.0)
    with _publisher(url) as pub:
        pub.publish(b1)
        pub.publish(b2)
    _wait_staged(sync, 2)
    assert sync.host.staged.manifest != served.manifest
    engine.fail_call = len(engine.calls) + 1
    with pytest.raises(EngineUpdateError, match="state is unknown") as err:
        sync.sync()
    assert "history was replaced" in str(err.value) and sync.served is None
    assert sync.sync().version == 2 and _holds(engine.params, b2)
    sync.close()


def test_engine_that_takes_a_weight_version_is_tagged_by_the_last_call(tmp_path) -> None:
    class TaggedEngine(FakeEngine):
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, weight_version=None):
            self.tags = [*getattr(self, "tags", []), weight_version]
            return super().update_weights_from_tensor(named_tensors, load_format, flush_cache)

    url = str(tmp_path / "store")
    engine = TaggedEngine()
    sync = SGLangSync(EngineApplier(engine, bucket_bytes=ONE_TENSOR), url, interval=0.02, threads=1)
    with _publisher(url) as pub:
        pub.publish(_state(2))
        sync.start(wait_s=DEADLINE_S)
        assert sync.sync().weight_version == "1"
    assert engine.tags == [None, None, None, "1"]
    sync.close()


def test_buckets_keep_order_and_bound_bytes() -> None:
    ts = [(str(i), torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([3, 3, 5, 1, 9, 2])]
    got = buckets(ts, 6)
    assert [[n for n, _ in b] for b in got] == [["0", "1"], ["2", "3"], ["4"], ["5"]]  # 9 bytes: alone
    assert buckets(ts, None) == [ts] and buckets([], 6) == [] and buckets([], None) == []


# --- the HTTP server ----------------------------------------------------------------------


class FakeServer:
    """What the stand-in ``sglang.launch_server`` holds and saw."""

    def __init__(self):
        self.params: dict[str, torch.Tensor] = {}
        self.weight_version: str | None = "default"
        self.calls: list[tuple[str, str, Any]] = []
        self.fail_call: int | None = None  # the update_weights_from_disk call that fails partway
        self.lock = threading.Lock()

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                path = urllib.parse.urlparse(self.path).path
                with server.lock:
                    server.calls.append((method, path, body))
                    if (method, path) not in SGLANG_ENDPOINTS:
                        return self._reply(404, {"detail": "Not Found"})
                    if path == "/get_weight_version":
                        return self._reply(200, {"weight_version": server.weight_version})
                    fields = DISK_FIELDS if path == "/update_weights_from_disk" else VERSION_FIELDS
                    if not set(body) <= fields:  # stricter than SGLang: an unknown field is a test failure
                        return self._reply(400, {"detail": f"unknown fields {sorted(set(body) - fields)}"})
                    if path == "/update_weight_version":
                        server.weight_version = body["new_version"]
                        return self._reply(200, {"success": True, "message": "ok", "new_version": body["new_version"]})
                    return self._reply(*server.load(body))

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        return Handler

    def load(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        from safetensors.torch import load_file

        n = sum(1 for _, p, _ in self.calls if p == "/update_weights_from_disk")
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))  # SGLang's loader globs them too
        tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
        for i, (name, t) in enumerate(sorted(tensors.items())):
            if n == self.fail_call and i == 1:
                return 400, {"success": False, "message": "Failed to update weights: stand-in failure",
                             "num_paused_requests": 0}
            self.params[name] = t
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def updates(self) -> list[dict[str, Any]]:
        return [b for _, p, b in self.calls if p == "/update_weights_from_disk"]


def test_server_applier_swaps_through_files_and_tags_the_version(tmp_path) -> None:
    url = str(tmp_path / "store")
    fake = FakeServer()
    work = tmp_path / "work"
    with http_server(fake.handler()) as engine_url:
        applier = ServerApplier(engine_url, work, bucket_bytes=3 * ONE_TENSOR)
        sync = SGLangSync(applier, url, interval=0.02, threads=1)
        v1 = _state(3)
        with _publisher(url) as pub:
            pub.publish(v1, metadata={"model_version": 1})
            sync.start(wait_s=DEADLINE_S)
            assert sync.sync().version == 1 and _holds(fake.params, v1)
            assert fake.weight_version == "1" == applier.weight_version()
            first = fake.updates()
            assert [b.get("weight_version") for b in first] == [None, "1"]  # only the last call tags ...
            assert [b["flush_cache"] for b in first] == [False, True]  # ... and flushes the prefix cache
            assert all(b["abort_all_requests"] is False for b in first)
            kept = sorted(p.name for p in work.iterdir())
            assert len(kept) == 2 and all(Path(b["model_path"]).is_dir() for b in first)

            v2 = _changed(v1, [1], 8.0)
            pub.publish(v2, metadata={"model_version": 2})
            _wait_staged(sync, 2)
            assert sync.sync().version == 2 and _holds(fake.params, v2) and fake.weight_version == "2"
            last = fake.updates()[-1]
            from safetensors.torch import load_file

            assert list(load_file(str(Path(last["model_path"]) / "model.safetensors"))) == [
                "model.layers.1.mlp.up_proj.weight"]  # the file holds only what changed
            assert sorted(p.name for p in work.iterdir()) == [Path(last["model_path"]).name]  # older files deleted

            # A version that changed nothing moves only the tag, without aborting requests.
            applier.apply([], ServedVersion(3, None, 3, "m3"))
            assert fake.calls[-1] == ("POST", "/update_weight_version", {"new_version": "3", "abort_all_requests": False})
        sync.close()
    assert work.is_dir() and not any(work.iterdir())  # the caller's directory stays, emptied


def test_server_failing_on_the_second_call_keeps_the_old_version(tmp_path) -> None:
    url = str(tmp_path / "store")
    fake = FakeServer()
    with http_server(fake.handler()) as engine_url:
        sync = SGLangSync(ServerApplier(engine_url, bucket_bytes=2 * ONE_TENSOR), url, interval=0.02, threads=1)
        v1 = _state(4)
        with _publisher(url) as pub:
            pub.publish(v1)
            sync.start(wait_s=DEADLINE_S)
            sync.sync()
            v2 = _changed(v1, [0, 1, 2, 3], 0.5)
            pub.publish(v2)
            _wait_staged(sync, 2)
            fake.fail_call = len(fake.updates()) + 2  # the second file of the next sync: takes 1 of its 2 tensors
            with pytest.raises(EngineUpdateError, match="put back at version 1"):
                sync.sync()
            assert _holds(fake.params, v1) and fake.weight_version == "1" and sync.served.version == 1
            assert sync.sync().version == 2 and _holds(fake.params, v2) and fake.weight_version == "2"
        sync.close()


def test_unreachable_server_on_a_first_load_leaves_the_state_unknown(tmp_path) -> None:
    url = str(tmp_path / "store")
    with _publisher(url) as pub:
        pub.publish(_state(5))
    with http_server(FakeServer().handler()) as engine_url:
        pass  # a port nobody listens on any more
    sync = SGLangSync(ServerApplier(engine_url, timeout_s=5), url, interval=0.02, threads=1)
    sync.start(wait_s=DEADLINE_S)
    with pytest.raises(EngineUpdateError, match="state is unknown") as err:
        sync.sync()
    assert "could not be reached" in str(err.value) and sync.status()["engine_state_unknown"]
    sync.close()


def test_stand_ins_match_sglang_sources(tmp_path) -> None:
    params = inspect.signature(FakeEngine.update_weights_from_tensor).parameters
    assert {n: p.default for n, p in params.items() if n != "self"} == ENGINE_UPDATE_PARAMS
    # The in-process applier calls the engine with exactly those keywords.
    url = str(tmp_path / "store")
    seen: list[set[str]] = []

    class Spy:
        def update_weights_from_tensor(self, **kwargs):
            seen.append(set(kwargs))
            return True, "Success"

    sync = SGLangSync(EngineApplier(Spy()), url, interval=0.02, threads=1)
    with _publisher(url) as pub:
        pub.publish(_state(6))
        sync.start(wait_s=DEADLINE_S)
        sync.sync()
    sync.close()
    assert seen == [set(ENGINE_UPDATE_PARAMS)]
