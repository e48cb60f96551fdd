"""Stand-ins for vLLM that the engine-integration tests share (vLLM cannot run here).

- :class:`RecordingModel`: a vLLM model's ``load_weights``, copying into its own parameters and
  recording what it was given (and failing on demand, partway through a call).
- :class:`Worker`: what ``--worker-extension-cls`` makes: a worker with the extension mixed in;
  the ranks of one engine vote through a :class:`ThreadGroup` (vLLM's gloo CPU group).
- the ``vllm_server`` fixture: a real local HTTP server answering the endpoints
  :class:`~deltastore.integrations.vllm.VLLMServerSync` calls, as ``vllm serve`` does with
  ``VLLM_SERVER_DEV_MODE=1`` (paths, bodies and replies as read in vLLM's source: see
  ``VLLM_ENDPOINTS`` and test_vllm.py's source check). ``/collective_rpc`` runs the method on
  every rank at once, each in its own thread, as vLLM's executor does.
"""

from __future__ import annotations

import functools
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deltastore.integrations.hostcopy import agree_over
from deltastore.integrations.vllm import DeltastoreWorkerExtension
from testkit.servers import http_server

#: The endpoints of a ``vllm serve`` engine the client uses: method and path (the stand-in
#: serves exactly these; test_vllm.py checks them against the vLLM sources they were read from).
VLLM_ENDPOINTS = {("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"),
                  ("GET", "/weight_info"), ("POST", "/pause"), ("POST", "/resume")}


class RecordingModel:
    """Stands in for a vLLM model: load_weights copies what it is given into its own
    (device-side) parameters and records the names and the thread.

    ``fail_after``: the next call raises after copying this many tensors (then resets).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.params = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
        self.calls: list[list[str]] = []
        self.threads: set[int] = set()
        self.fail_after: int | None = None

    def load_weights(self, weights):
        names = []
        fail, self.fail_after = self.fail_after, None
        for n, t in weights:
            if fail is not None and len(names) == fail:
                self.calls.append(names)
                raise RuntimeError(f"stand-in load_weights failed after {fail} tensors")
            self.params[n].copy_(t)
            names.append(n)
        self.calls.append(names)
        self.threads.add(threading.get_ident())
        return set(names)

    def holds(self, state: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(self.params[n], t.to(torch.bfloat16)) for n, t in state.items())


class ThreadGroup:
    """An all-gather across ``n`` threads: stands in for one of vLLM's CPU process groups."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list[Any] = [None] * n

    def gather(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out


class Worker(DeltastoreWorkerExtension):
    """What vLLM's --worker-extension-cls makes: a worker class with the extension mixed in.
    With ``group``, it is rank ``rank`` of a multi-rank engine and votes through it."""

    def __init__(self, model: RecordingModel, group: ThreadGroup | None = None, rank: int = 0):
        self.model_runner = SimpleNamespace(model=model)
        self._group, self._rank = group, rank

    def _deltastore_agreement(self):
        if self._group is None:
            return None
        return functools.partial(agree_over, gathers=[functools.partial(self._group.gather, self._rank)])


def on_all_ranks(workers: list[Worker], method: str, *args: Any, **kwargs: Any) -> list[Any]:
    """``collective_rpc``: ``method`` on every rank at once; the first error is raised."""
    results: list[Any] = [None] * len(workers)
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            results[i] = getattr(workers[i], method)(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


@dataclass
class VLLMStandIn:
    """What the stand-in server saw and holds."""

    url: str
    workers: list[Worker]
    calls: list[tuple[str, str, Any]] = field(default_factory=list)  # (method, path with query, body)
    weight_version: str | None = None
    missing: set[str] = field(default_factory=set)  # paths answered 404 (an older vLLM)
    paused: bool = False

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.calls]


def _handler(state: VLLMStandIn) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: Any = None) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            url = urllib.parse.urlparse(self.path)
            state.calls.append((method, self.path, body))
            if (method, url.path) not in VLLM_ENDPOINTS or url.path in state.missing:
                return self._reply(404, {"detail": "Not Found"})
            if url.path == "/collective_rpc":
                try:
                    results = on_all_ranks(state.workers, body["method"], *body.get("args", []), **body.get("kwargs", {}))
                except Exception as e:  # noqa: BLE001 - vLLM answers a worker's exception with 500
                    return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
                return self._reply(200, {"results": results})
            if url.path == "/update_weight_version":
                state.weight_version = body["new_version"]
                return self._reply(200, {"success": True, "new_version": body["new_version"]})
            if url.path == "/weight_info":
                return self._reply(200, {"weight_version": state.weight_version})
            if url.path == "/pause":
                state.paused = True
                return self._reply(200, {"status": "paused"})
            if url.path == "/resume":
                state.paused = False
                return self._reply(200, {"status": "resumed"})
            return self._reply(200)  # /reset_prefix_cache answers an empty 200

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

    return Handler


@pytest.fixture
def vllm_server() -> Iterator[Any]:
    """A factory: ``vllm_server(workers, missing=())`` starts a stand-in ``vllm serve`` whose
    ranks are ``workers`` and returns its :class:`VLLMStandIn`; stopped at teardown."""
    stack: list[Any] = []

    def start(workers: list[Worker], missing: tuple[str, ...] = ()) -> VLLMStandIn:
        state = VLLMStandIn(url="", workers=workers, missing=set(missing))
        cm = http_server(_handler(state))
        state.url = cm.__enter__()
        stack.append(cm)
        return state

    yield start
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


@pytest.fixture
def vllm_parts() -> SimpleNamespace:
    """The stand-in's parts, for tests that build workers themselves: ``RecordingModel``,
    ``Worker``, ``ThreadGroup``, ``on_all_ranks`` and ``VLLM_ENDPOINTS``."""
    return SimpleNamespace(RecordingModel=RecordingModel, Worker=Worker, ThreadGroup=ThreadGroup,
                           on_all_ranks=on_all_ranks, VLLM_ENDPOINTS=VLLM_ENDPOINTS)
