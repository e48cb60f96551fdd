"""AdapterFollower and swap_adapter against stand-in vLLM and SGLang servers over real HTTP.

The stand-ins answer the routes, JSON fields and status codes the real servers use, as read in
their sources:

- vLLM (vllm-project/vllm at 055e47c2): ``vllm/frontend/entrypoints/serve/lora/api_router.py``
  (``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``: 200 with a plain-text
  "Success: ...", errors as ``{"error": {"message", "type", "param", "code"}}``),
  ``vllm/frontend/entrypoints/openai/models/serving.py`` (400 for a name already loaded, 404 for
  an unknown one or a missing path, 500 when the engine fails to load; the name is registered
  only after the load succeeded; ``GET /v1/models`` lists adapters with ``id`` = ``lora_name``),
  ``vllm/frontend/entrypoints/serve/dev/cache/api_router.py`` (``POST /reset_prefix_cache`` →
  ``{"success": bool}``).
- SGLang (sgl-project/sglang at 0025436e): ``python/sglang/srt/entrypoints/http_server.py``
  (``POST /load_lora_adapter``, ``POST /unload_lora_adapter`` answer ``LoRAUpdateOutput`` with
  200 on success and 400 otherwise; ``/flush_cache`` 200 or 400 while requests run;
  ``GET /v1/models`` lists the registered adapters), ``managers/io_struct.py``
  (``LoadLoRAAdapterReqInput``: ``lora_name``, ``lora_path``, ``pinned``; ``LoRAUpdateOutput``:
  ``success``, ``error_message``, ``loaded_adapters``), ``lora/lora_registry.py`` (a name
  already registered is refused).

Like the real engines, a stand-in reads the adapter directory it is asked to load (config and
safetensors) and refuses one it cannot read; it keeps the tensors it loaded, so the tests
compare what the engine got with what the trainer published, bit for bit.
"""

from __future__ import annotations

import http.server
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from deltastore import Subscriber
from deltastore.errors import AdapterMismatchError, EngineUpdateError
from deltastore.integrations.adapters import (
    AdapterFollower,
    SGLangAdapterClient,
    VLLMAdapterClient,
    served_name,
    served_version,
    swap_adapter,
)
from deltastore.integrations.peft import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterPublisher,
    BaseLayout,
    BaseRef,
    write_adapter_dir,
)
from deltastore.read.follow import PollPolicy
from testkit.servers import http_server

BASE = "tiny-base"
MODULES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj")
HIDDEN, RANK = 16, 4
CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
          "base_model_name_or_path": BASE, "fan_in_fan_out": False, "rank_pattern": {}, "bias": "none"}
#: The base the adapter is trained on, as parameter shapes: q (16→16), v (16→8).
LAYOUT = BaseLayout({f"{MODULES[0]}.weight": (HIDDEN, HIDDEN), f"{MODULES[1]}.weight": (HIDDEN // 2, HIDDEN),
                     "model.embed_tokens.weight": (32, HIDDEN)}, BASE)
FAST = PollPolicy(interval=0.001, jitter=0.0, max_interval=0.004)


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    """One version's LoRA factors, as PEFT saves them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, width in zip(MODULES, (HIDDEN, HIDDEN // 2)):
        out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g)
        out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(width, RANK, generator=g) * 0.01
    return out


@dataclass
class _Engine:
    """The stand-in's state and its failure knobs (set by the tests)."""

    kind: str
    adapters: dict[str, str] = field(default_factory=dict)  # name → path
    loaded: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name → tensors read at load
    calls: list[tuple[str, Any]] = field(default_factory=list)
    refuse_load: set[str] = field(default_factory=set)  # answer an engine error
    drop_after_load: set[str] = field(default_factory=set)  # register, then cut the connection
    drop_before_load: set[str] = field(default_factory=set)  # cut the connection, load nothing
    hide: set[str] = field(default_factory=set)  # answer success, never list it
    refuse_unload: set[str] = field(default_factory=set)
    busy: bool = False  # requests running: the prefix cache cannot be reset
    refused_loads: int = 0
    on_refused: threading.Event = field(default_factory=threading.Event)
    refusals_to_signal: int = 0


def _handler(engine: _Engine) -> type[http.server.BaseHTTPRequestHandler]:
    vllm = engine.kind == "vllm"

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: Any, *, text: bool = False) -> None:
            data = body.encode() if text else json.dumps(body).encode()
            self.send_response(status)
            if not text:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            if vllm:
                error = {"message": message, "type": "InvalidUserInput", "param": None, "code": status}
                self._send(status, {"error": error})
            else:
                self._send(status, {"success": False, "error_message": message, "loaded_adapters": None})

        def _ok(self, name: str, verb: str) -> None:
            if vllm:
                self._send(200, f"Success: LoRA adapter '{name}' {verb} successfully.", text=True)
            else:
                self._send(200, {"success": True, "error_message": None, "loaded_adapters": dict(engine.adapters)})

        def do_GET(self) -> None:
            engine.calls.append(("GET", self.path))
            if self.path != "/v1/models":
                return self._error(404, "Not Found")
            cards = [{"id": BASE, "object": "model", "root": BASE}]
            cards += [{"id": n, "object": "model", "root": p, "parent": BASE}
                      for n, p in engine.adapters.items() if n not in engine.hide]
            self._send(200, {"object": "list", "data": cards})

        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(size)) if size else {}
            engine.calls.append((self.path, body.get("lora_name")))
            load, unload = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") if vllm else \
                ("/load_lora_adapter", "/unload_lora_adapter")
            if self.path == load:
                return self._load(body)
            if self.path == unload:
                name = body["lora_name"]
                if name not in engine.adapters or name in engine.refuse_unload:
                    return self._error(404 if vllm else 400, f"The lora adapter '{name}' cannot be found.")
                del engine.adapters[name]
                return self._ok(name, "removed")
            if self.path == ("/reset_prefix_cache" if vllm else "/flush_cache"):
                if vllm:
                    return self._send(200, {"success": not engine.busy})
                return self._send(400 if engine.busy else 200, "Cache flushed.\n", text=True)
            self._error(404, "Not Found")

        def _load(self, body: dict[str, Any]) -> None:
            name, path = body["lora_name"], body["lora_path"]
            assert set(body) == ({"lora_name", "lora_path"} if vllm else {"lora_name", "lora_path", "pinned"})
            if name in engine.drop_before_load:
                self.close_connection = True
                return
            if name in engine.adapters:
                return self._error(400, f"The lora adapter '{name}' has already been loaded.")
            if name in engine.refuse_load:
                engine.refused_loads += 1
                if engine.refused_loads == engine.refusals_to_signal:
                    engine.on_refused.set()
                return self._error(500 if vllm else 400, "CUDA out of memory while loading the adapter")
            try:  # what the engines read: the config, then the tensors
                config = json.loads((Path(path) / CONFIG_NAME).read_text())
                tensors = load_file(str(Path(path) / WEIGHTS_NAME))
                assert config["peft_type"] == "LORA" and Path(path).is_absolute()
            except (OSError, ValueError, KeyError, AssertionError) as e:
                return self._error(404 if vllm else 400, f"No adapter found for {path}: {e}")
            engine.adapters[name] = path
            engine.loaded[name] = tensors
            if name in engine.drop_after_load:
                self.close_connection = True
                return
            self._ok(name, "added")

    return Handler


@pytest.fixture(scope="module")
def servers() -> Any:
    """One stand-in of each kind for the module (a server's shutdown waits out its poll interval)."""
    engines = {kind: _Engine(kind) for kind in ("vllm", "sglang")}
    with http_server(_handler(engines["vllm"])) as vllm_url, http_server(_handler(engines["sglang"])) as sglang_url:
        yield {"vllm": (engines["vllm"], vllm_url), "sglang": (engines["sglang"], sglang_url)}


def _fresh(servers: Any, kind: str) -> tuple[_Engine, Any]:
    """The stand-in of ``kind``, emptied, and a client of it."""
    engine, url = servers[kind]
    engine.__init__(kind)  # a fresh state: no adapters, no calls, no failure knobs
    client = VLLMAdapterClient(url, timeout=10) if kind == "vllm" else SGLangAdapterClient(url, timeout=10, pinned=True)
    return engine, client


@pytest.fixture(params=["vllm", "sglang"])
def stand_in(request: pytest.FixtureRequest, servers: Any) -> Any:
    return _fresh(servers, request.param)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    url = str(tmp_path / "adapter-store")
    pub = AdapterPublisher(url, base=BaseRef(BASE, store="memory://base", version=1))
    yield url, pub
    pub.close()


def _follower(url: str, client: Any, tmp_path: Path, **kw: Any) -> AdapterFollower:
    kw.setdefault("base", LAYOUT)
    return AdapterFollower(url, client, name="policy", stage_dir=tmp_path / "stage", poll=FAST, **kw)


def _same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        got[n].dtype == want[n].dtype and torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)


def test_each_version_is_loaded_verified_then_the_old_one_unloaded(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    pointed: list[str] = []
    with _follower(url, client, tmp_path, expect_base=BASE, on_swap=lambda n, v: engine.calls.append(("on_swap", n))) as f:
        assert f.sync() is None and f.served is None  # an empty store: nothing to serve
        for seed in (1, 2, 3):
            published = _adapter(seed)
            info = pub.publish_state(published, CONFIG, step=seed * 10)
            engine.calls.clear()
            result = f.sync()
            new, old = served_name("policy", info.version), served_name("policy", info.version - 1)
            assert result is not None and result.served == new == f.served and result.version == info.version
            pointed.append(new)
            # load under its own name, verify it is listed, point clients at it, and only then unload the old one
            load = "/v1/load_lora_adapter" if engine.kind == "vllm" else "/load_lora_adapter"
            unload = "/v1/unload_lora_adapter" if engine.kind == "vllm" else "/unload_lora_adapter"
            want = [("GET", "/v1/models"), (load, new), ("GET", "/v1/models"), ("on_swap", new)]
            if info.version > 1:
                want.append((unload, old))
            assert engine.calls == want
            assert result.unloaded == ((old,) if info.version > 1 else ()) and result.stale == ()
            assert result.previous == (old if info.version > 1 else None) and result.prefix_cache_reset is None
            assert set(engine.adapters) == {new}
            assert _same_bits(engine.loaded[new], published)  # what the engine read is what was trained
            assert f.sync() is None  # nothing newer
        # the served version and the one before it stay staged (engines may read them again)
        assert sorted(p.name for p in (tmp_path / "stage").iterdir()) == ["policy@2", "policy@3"]
        assert f.status().served_version == 3 and f.status().error is None
    assert pointed == ["policy@1", "policy@2", "policy@3"]


def test_a_refused_load_keeps_the_old_adapter_serving(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    pub.publish_state(_adapter(1), CONFIG)
    with _follower(url, client, tmp_path) as f:
        f.sync()
        second = _adapter(2)
        pub.publish_state(second, CONFIG)
        engine.refuse_load.add("policy@2")
        with pytest.raises(EngineUpdateError) as err:
            f.sync()
        message = str(err.value)
        assert "'policy@2'" in message and "'policy@1' keeps serving" in message and "out of memory" in message
        assert set(engine.adapters) == {"policy@1"} and f.served == "policy@1"  # never unloaded
        assert f.status().error == message and f.status().staged_version == 2
        engine.refuse_load.clear()  # the engine recovers: the staged version is loaded
        result = f.sync()
        assert result is not None and result.served == "policy@2" and set(engine.adapters) == {"policy@2"}
        assert _same_bits(engine.loaded["policy@2"], second) and f.status().error is None


def test_a_lost_answer_is_settled_by_the_engines_list(tmp_path: Path, store: Any, servers: Any) -> None:
    engine, client = _fresh(servers, "vllm")
    url, pub = store
    pub.publish_state(_adapter(1), CONFIG)
    with _follower(url, client, tmp_path) as f:
        engine.drop_after_load.add("policy@1")  # loaded, but the answer never came
        assert f.sync().served == "policy@1" and set(engine.adapters) == {"policy@1"}
        pub.publish_state(_adapter(2), CONFIG)
        engine.drop_before_load.add("policy@2")  # no answer and nothing loaded
        with pytest.raises(EngineUpdateError, match="no answer from the engine .* does not list the adapter; "
                                                    "'policy@1' keeps serving"):
            f.sync()
        assert set(engine.adapters) == {"policy@1"}


def test_a_load_the_engine_does_not_list_is_undone(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    pub.publish_state(_adapter(1), CONFIG)
    with _follower(url, client, tmp_path) as f:
        f.sync()
        pub.publish_state(_adapter(2), CONFIG)
        engine.hide.add("policy@2")
        with pytest.raises(EngineUpdateError, match="answered the load but does not list"):
            f.sync()
        assert set(engine.adapters) == {"policy@1"}  # the half-done load was unloaded, the old one kept
        assert engine.calls[-1][1] == "policy@2" and "unload" in engine.calls[-1][0]


@pytest.mark.parametrize("busy", [False, True])
def test_the_prefix_cache_is_reset_only_when_asked(stand_in: Any, store: Any, tmp_path: Path, busy: bool) -> None:
    engine, client = stand_in
    url, pub = store
    reset = "/reset_prefix_cache" if engine.kind == "vllm" else "/flush_cache"
    pub.publish_state(_adapter(1), CONFIG)
    with _follower(url, client, tmp_path) as f:  # default: keep
        assert f.sync().prefix_cache_reset is None
    assert all(c[0] != reset for c in engine.calls)
    pub.publish_state(_adapter(2), CONFIG)
    engine.busy, engine.calls[:] = busy, []
    with _follower(url, client, tmp_path, prefix_cache="reset") as f:
        result = f.sync()
    assert result.served == "policy@2" and set(engine.adapters) == {"policy@2"}  # swapped either way
    assert result.prefix_cache_reset is (not busy)
    unload = "/v1/unload_lora_adapter" if engine.kind == "vllm" else "/unload_lora_adapter"
    assert [c[0] for c in engine.calls][-2:] == [unload, reset]  # after the old version is unloaded


def test_an_adapter_that_does_not_fit_the_base_never_reaches_the_engine(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    pub.publish_state(_adapter(1), CONFIG)
    wider = BaseLayout({**LAYOUT.shapes, f"{MODULES[0]}.weight": (HIDDEN, 2 * HIDDEN)}, BASE)
    with _follower(url, client, tmp_path, base=wider) as f, pytest.raises(AdapterMismatchError) as err:
        f.sync()
    assert "q_proj.lora_A.weight has 16 input features, the base's model.layers.0.self_attn.q_proj has 32" in str(err.value)
    with _follower(url, client, tmp_path, expect_base="another-base") as f, \
            pytest.raises(AdapterMismatchError, match="trained on base 'tiny-base'"):
        f.sync()
    with _follower(url, client, tmp_path, base=wider) as f, pytest.raises(AdapterMismatchError):
        list(f.run())  # a configuration error: run raises it rather than retrying
    assert not any(c[0].endswith("load_lora_adapter") for c in engine.calls) and not engine.adapters


def test_an_old_version_left_loaded_is_unloaded_at_the_next_swap(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    pub.publish_state(_adapter(1), CONFIG)
    with _follower(url, client, tmp_path) as f:
        f.sync()
        pub.publish_state(_adapter(2), CONFIG)
        engine.refuse_unload.add("policy@1")
        result = f.sync()
        assert result.served == "policy@2" and result.stale == ("policy@1",) and result.unloaded == ()
        engine.refuse_unload.clear()
        pub.publish_state(_adapter(3), CONFIG)
        assert f.sync().unloaded == ("policy@1", "policy@2") and set(engine.adapters) == {"policy@3"}


def test_retained_versions_stay_loaded_and_staged(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    with _follower(url, client, tmp_path, retain=1) as f:
        for seed in (1, 2, 3, 4):
            pub.publish_state(_adapter(seed), CONFIG)
            f.sync()
        assert set(engine.adapters) == {"policy@3", "policy@4"}
        assert sorted(p.name for p in (tmp_path / "stage").iterdir()) == ["policy@2", "policy@3", "policy@4"]


def test_a_restarted_follower_adopts_what_the_engine_serves(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    pub.publish_state(_adapter(1), CONFIG)
    pub.publish_state(_adapter(2), CONFIG)
    with _follower(url, client, tmp_path) as f:
        assert f.sync().served == "policy@2"
    engine.calls.clear()
    with _follower(url, client, tmp_path) as f:
        assert f.served == "policy@2" and f.sync() is None
    assert all(not c[0].endswith("load_lora_adapter") for c in engine.calls)


def test_run_gives_up_on_a_version_the_engine_keeps_refusing(stand_in: Any, store: Any, tmp_path: Path) -> None:
    engine, client = stand_in
    url, pub = store
    pub.publish_state(_adapter(1), CONFIG)
    with _follower(url, client, tmp_path) as f:
        assert [r.served for r in f.run(max_versions=1)] == ["policy@1"]
        pub.publish_state(_adapter(2), CONFIG)
        engine.refuse_load.add("policy@2")
        engine.refusals_to_signal = 3  # the stand-in stops the loop as it refuses the third load
        assert list(f.run(stop=engine.on_refused)) == []
        assert engine.refused_loads == 3 and f.status().failed_version == 2 and f.served == "policy@1"
        assert "'policy@1' keeps serving" in f.status().error
        assert f.sync() is None  # given up until a newer version is published
        pub.publish_state(_adapter(3), CONFIG)
        engine.refuse_load.clear()
        assert [r.served for r in f.run(max_versions=1)] == ["policy@3"]
        assert f.status().failed_version is None and set(engine.adapters) == {"policy@3"}


def test_swap_adapter_alone_and_served_names(tmp_path: Path, servers: Any) -> None:
    engine, client = _fresh(servers, "sglang")
    path = write_adapter_dir(tmp_path / "policy@7", _adapter(7), CONFIG)
    result = swap_adapter(client, name="policy", version=7, path=path, source="s3://bucket/adapter")
    assert result.served == "policy@7" and result.unloaded == () and set(engine.adapters) == {"policy@7"}
    engine.calls.clear()  # the version already served: nothing is reloaded under its clients
    assert swap_adapter(client, name="policy", version=7, path=path, previous="policy@7").served == "policy@7"
    assert engine.calls == [] and set(engine.adapters) == {"policy@7"}
    with pytest.raises(EngineUpdateError, match="could not serve version 8 of s3://bucket/adapter as 'policy@8': "
                                                "refused to load adapter 'policy@8'"):
        swap_adapter(client, name="policy", version=8, path=tmp_path / "missing", previous="policy@7",
                     source="s3://bucket/adapter")
    assert set(engine.adapters) == {"policy@7"}
    assert served_version("policy", "policy@12") == 12
    assert [served_version("policy", n) for n in ("policy@", "policy@012", "policy2@1", "other@3", "policy@1x")] == \
        [None] * 5


def test_an_adapter_directory_is_written_whole_or_not_at_all(tmp_path: Path, store: Any) -> None:
    with pytest.raises(TypeError):  # fails after the tensors were written: nothing may be left behind
        write_adapter_dir(tmp_path / "a", _adapter(1), {"peft_type": "LORA", "bad": object()})
    assert not (tmp_path / "a").exists() and not any(p.name.startswith(".a.") for p in tmp_path.iterdir())
    path = write_adapter_dir(tmp_path / "a", _adapter(1), CONFIG, marker={"version": 1})
    assert _same_bits(load_file(str(path / WEIGHTS_NAME)), _adapter(1))
    with pytest.raises(FileExistsError):
        write_adapter_dir(tmp_path / "a", _adapter(2), CONFIG)
    # a directory a subscriber pulled holds exactly what was published (group buffers split)
    url, pub = store
    pub.publish_state(_adapter(5), CONFIG)
    with Subscriber(url) as sub:
        assert _same_bits(load_file(str(write_adapter_dir(tmp_path / "b", sub.pull(), CONFIG) / WEIGHTS_NAME)), _adapter(5))
