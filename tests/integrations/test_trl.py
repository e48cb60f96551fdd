"""The TRL backend: DeltastoreWeightTransfer against TRL's real AsyncGRPOTrainer
on CPU, and its contract in isolation (draining, dtype, names, failures, ranks).

The trainer test patches only what TRL cannot do without CUDA (examples/trl_grpo.py
``run_trl_on_cpu``: the FlashAttention-3 kernel of its tree-packing attention and the CUDA
device-name lookup of its MFU metric); the rollout worker is a stub that queues samples of
random tokens.
"""

from __future__ import annotations

import itertools
import os
import queue
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deltastore import Publisher, Subscriber
from deltastore.errors import FencedError
from deltastore.integrations._common import clean_name, tied_weights_of
from deltastore.integrations.trl import DeltastoreWeightTransfer
from deltastore.write.publisher import handed_over
from testkit.trl import tiny_async_grpo, trl_example

ROOT = Path(__file__).resolve().parents[2]


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed.weight": torch.randn(16, 8, generator=g), "model.layer.weight": torch.randn(8, 8, generator=g),
            "model.layer.bias": torch.randn(8, generator=g)}


class _Counting:
    """An iterator of (name, tensor) that counts what was taken (a rank's lockstep stream)."""

    def __init__(self, items):
        self.items, self.taken = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.taken += 1
            yield item


# --- the contract, without a trainer -----------------------------------------------------


def test_send_weights_publishes_served_dtype_and_model_version(tmp_path) -> None:
    url = str(tmp_path / "store")
    wt = DeltastoreWeightTransfer(url, tied_weights={"lm_head.weight": "model.embed.weight"}, metadata={"run": "t"})
    assert wt.publisher is None  # every rank builds it; nothing is opened before init
    wt.init_weight_transfer()
    sent = []
    for k in range(3):
        p = _params(k)
        wt.pause()
        wt.send_weights(iter([(f"module._orig_mod.{n}", t) for n, t in p.items()]))
        wt.resume()
        sent.append(p)
    wt.destroy()
    wt.destroy()  # idempotent
    with Subscriber(url, threads=1) as sub:
        log = sub.log()
        assert [i.metadata["model_version"] for i in log] == [1, 2, 3]
        assert [i.step for i in log] == [1, 2, 3]
        assert log[-1].metadata["tied_weights"] == {"lm_head.weight": "model.embed.weight"}
        assert log[-1].metadata["run"] == "t"
        for i, p in zip(log, sent):
            got = sub.pull(i.version)
            assert set(got) == set(p)  # wrapper prefixes stripped
            for n, t in p.items():
                assert got[n].dtype == torch.bfloat16
                assert torch.equal(got[n], t.to(torch.bfloat16))


def test_send_weights_drains_everything_on_error_and_publishes_nothing(tmp_path) -> None:
    url = str(tmp_path / "store")
    wt = DeltastoreWeightTransfer(url)
    wt.init_weight_transfer()
    items = list(_params().items())
    stream = _Counting([items[0], ("model.bad", "not a tensor"), *items[1:]])
    with pytest.raises(AttributeError):
        wt.send_weights(iter(stream))
    assert stream.taken == len(items) + 1  # drained to the end for the other ranks' collectives
    wt.destroy()
    with Subscriber(url, threads=1) as sub:
        assert sub.log() == []
    # A name sent twice (after prefix removal) is refused the same way, after draining.
    wt = DeltastoreWeightTransfer(url)
    stream = _Counting([("module.a", torch.ones(2)), ("a", torch.ones(2)), ("b", torch.ones(2))])
    with pytest.raises(Exception, match="'a' twice"):
        wt.send_weights(iter(stream))
    assert stream.taken == 3
    wt.destroy()


def test_background_failure_surfaces_on_next_send_after_draining(tmp_path) -> None:
    url = str(tmp_path / "store")
    wt = DeltastoreWeightTransfer(url)
    wt.init_weight_transfer()
    wt.send_weights(iter(_params(0).items()))
    wt.flush()
    Publisher(url).close()  # a newer publisher takes the store over: ours is fenced
    wt.send_weights(iter(_params(1).items()))  # queued; fails in the background
    with pytest.raises(FencedError):
        wt.futures[-1].result(timeout=60)
    stream = _Counting(_params(2).items())
    with pytest.raises(FencedError):
        wt.send_weights(iter(stream))
    assert stream.taken == 3
    wt.destroy()  # the failure was reported once; closing does not raise it again


def test_background_failure_surfaces_on_destroy(tmp_path) -> None:
    url = str(tmp_path / "store")
    wt = DeltastoreWeightTransfer(url)
    wt.init_weight_transfer()
    wt.send_weights(iter(_params(0).items()))
    wt.flush()
    Publisher(url).close()
    wt.send_weights(iter(_params(1).items()))
    with pytest.raises(FencedError):
        wt.destroy()


def test_copies_are_handed_over_not_copied_again(tmp_path, monkeypatch) -> None:
    seen = {}
    real = Publisher.publish_async

    def spy(self, state, **kw):
        seen.update(kw, ptrs={n: t.data_ptr() for n, t in state.items()}, dtypes={t.dtype for t in state.values()})
        fut = real(self, state, **kw)
        return fut

    monkeypatch.setattr(Publisher, "publish_async", spy)
    captured = {}
    real_commit = Publisher._publish_snapshot

    def commit(self, state, **kw):
        captured.update({n: t.data_ptr() for n, t in state.items()})
        return real_commit(self, state, **kw)

    monkeypatch.setattr(Publisher, "_publish_snapshot", commit)
    p = _params()
    wt = DeltastoreWeightTransfer(str(tmp_path / "store"))
    wt.send_weights(iter(p.items()))  # opens the publisher itself when init was not called
    wt.destroy()
    assert seen["copy"] is False and seen["dtypes"] == {torch.bfloat16}
    assert captured == seen["ptrs"]  # the background commit got the backend's copies, not new ones
    assert not set(seen["ptrs"].values()) & {t.data_ptr() for t in p.values()}  # never the live params


def test_handed_over_keeps_ready_tensors_and_copies_others() -> None:
    ready = torch.zeros(4, dtype=torch.bfloat16)
    fp32 = torch.ones(4)
    ints = torch.arange(3)
    out = handed_over({"a": ready, "b": fp32, "c": ints}, torch.bfloat16)
    assert list(out) == ["a", "b", "c"]
    assert out["a"].data_ptr() == ready.data_ptr() and out["c"].data_ptr() == ints.data_ptr()
    assert out["b"].dtype == torch.bfloat16 and out["b"].data_ptr() != fp32.data_ptr()


def test_other_ranks_drain_and_hold_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    url = tmp_path / "store"
    wt = DeltastoreWeightTransfer(str(url))
    wt.init_weight_transfer()
    stream = _Counting(_params().items())
    wt.send_weights(iter(stream))
    assert stream.taken == 3 and wt.publisher is None and not url.exists()
    wt.destroy()


def test_names_and_tied_weights() -> None:
    assert clean_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight") == "model.layers.0.mlp.weight"
    assert clean_name("model.module.weight") == "model.module.weight"

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.embed.weight

    m = Tied()
    assert [n for n, _ in m.named_parameters()] == ["embed.weight"]
    assert tied_weights_of(m) == {"lm_head.weight": "embed.weight"}
    wt = DeltastoreWeightTransfer("memory://x", model=m)
    assert wt.metadata["tied_weights"] == {"lm_head.weight": "embed.weight"}


# --- TRL's real trainer --------------------------------------------------------------------


class _StubRolloutWorker:
    """TRL's RolloutWorkerProtocol: queues samples of random tokens, tagged with the version."""

    def __init__(self, vocab: int, per_sync: int = 16):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.versions: list[int] = []
        self._rng = np.random.default_rng(0)
        self._vocab, self._per_sync, self._group = vocab, per_sync, itertools.count()

    def _fill(self, version: int) -> None:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        for _ in range(self._per_sync // 4):
            group = next(self._group)
            for adv in (-1.0, -0.5, 0.5, 1.0):
                ids = self._rng.integers(5, self._vocab, size=10)
                self.rollout_buffer.put(RolloutSample(
                    prompt=[{"role": "user", "content": "p"}], completion=[{"role": "assistant", "content": "c"}],
                    input_ids=ids, completion_mask=np.array([0] * 4 + [1] * 6), old_log_probs=np.full(10, -3.0, np.float32),
                    advantage=adv, model_version=version, group_id=group, metrics={"reward": adv},
                ))

    def start(self) -> None:
        self._fill(0)

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)
        self._fill(model_version)

    def stop(self) -> None:
        pass

    def check_health(self, stale_after_s: float) -> None:
        pass


def test_async_grpo_trainer_publishes_every_sync(tmp_path, monkeypatch) -> None:
    pytest.importorskip("trl", minversion="1.16", reason="needs trl>=1.16 (pip install 'deltastore-weights[trl]')")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    ex = trl_example()
    url = str(tmp_path / "store")
    steps = 3
    worker = _StubRolloutWorker(vocab=len(ex.SPECIALS) + len(ex.WORDS))
    wt = DeltastoreWeightTransfer(url)
    trainer, _ = tiny_async_grpo(tmp_path, steps=steps, lr=1e-3, rollout_worker=worker, weight_transfer=wt)
    wt.model_version_fn = lambda: trainer.model_version  # TRL's own count (here equal to the backend's)
    trainer.train()
    assert wt.publisher is None  # destroy() ran at train end
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    with Subscriber(url, threads=1) as sub:
        log = sub.log()
        # the cold sync at train begin, then one per optimizer step; TRL's model_version in metadata
        assert [i.metadata["model_version"] for i in log] == list(range(1, steps + 2)) == worker.versions
        assert trainer.model_version == steps + 1
        assert log[0].kind == "anchor" and {i.kind for i in log[1:]} <= {"delta", "anchor"}
        final = sub.pull()
    assert "lm_head.weight" not in final  # tied: TRL sends named_parameters, which lists it once
    assert set(final) == set(params)
    for n, t in params.items():
        assert t.dtype == torch.float32 and final[n].dtype == torch.bfloat16
        assert torch.equal(final[n], t.to(torch.bfloat16)), n


def test_example_trl_grpo_runs(tmp_path, monkeypatch, capsys) -> None:
    """examples/trl_grpo.py's ``main`` with its command line, in this process: a fresh
    interpreter would spend most of the test importing TRL, transformers and datasets again."""
    pytest.importorskip("trl", minversion="1.16", reason="needs trl>=1.16 (pip install 'deltastore-weights[trl]')")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.chdir(tmp_path)
    code = trl_example().main(["--steps", "2", "--store", str(tmp_path / "store")])
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    lines = [ln for ln in out.out.splitlines() if ln.startswith("version")]
    assert len(lines) == 3 and "anchor" in lines[0] and "model_version 3" in lines[-1]
    assert "store head == trainer weights (bf16): True; worker bit-identical: True" in out.out


_RANK_SCRIPT = r'''
import datetime, json, os, sys
import torch
import torch.distributed as dist
from deltastore.integrations.trl import DeltastoreWeightTransfer

dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2, timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()

def stream(names):
    # FSDP2's full_tensor() is a collective per parameter: every rank must take every item.
    for i, name in enumerate(names):
        t = torch.full((4, 4), float(i))
        dist.all_reduce(t)
        yield name, t

wt = DeltastoreWeightTransfer(sys.argv[1])  # every rank builds it, as a training script does
out = {"rank": rank}
if rank == 0:
    wt.init_weight_transfer()
wt.send_weights(stream(["a", "b", "c"]))
try:
    wt.send_weights(stream(["module.a", "a", "b", "c"]))  # a duplicate name: refused on every rank
    out["second"] = "ok"
except Exception as e:
    out["second"] = type(e).__name__
t = torch.ones(1)
dist.all_reduce(t)  # both ranks reach this only if rank 0 drained the failed stream
out["after"] = t.item()
out["holds_publisher"] = wt.publisher is not None
wt.destroy()
dist.destroy_process_group()
print(json.dumps(out))
'''


@pytest.mark.distributed
def test_failed_send_keeps_ranks_in_lockstep(tmp_path) -> None:
    """Two gloo ranks whose stream is a collective per tensor: rank 0's failed send still drains
    it, so rank 1 is not left waiting in a collective; only rank 0 holds a publisher."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = str(tmp_path / "store")
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, url], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outs[0] == {"rank": 0, "second": "DeltastoreError", "after": 2.0, "holds_publisher": True}
    assert outs[1]["after"] == 2.0 and outs[1]["holds_publisher"] is False
    with Subscriber(url, threads=1) as sub:
        log = sub.log()
        assert len(log) == 1 and log[0].metadata["model_version"] == 1  # the failed sync published nothing
        got = sub.pull()
    assert sorted(got) == ["a", "b", "c"] and got["c"].eq(4.0).all()  # 2.0 on each rank, all-reduced


def test_backend_matches_trls_protocol_signatures() -> None:
    """Every method of TRL's WeightTransferProtocol exists here with the same parameters (a
    typing.Protocol is not checked at run time: this catches upstream API churn)."""
    pytest.importorskip("trl", minversion="1.16", reason="needs trl>=1.16 (pip install 'deltastore-weights[trl]')")
    import inspect

    from trl.experimental.async_grpo.async_grpo_trainer import WeightTransferProtocol

    methods = [n for n, v in vars(WeightTransferProtocol).items() if callable(v) and not n.startswith("_")]
    assert set(methods) == {"init_weight_transfer", "pause", "send_weights", "resume", "destroy"}
    for name in methods:
        theirs = list(inspect.signature(getattr(WeightTransferProtocol, name)).parameters)
        ours = list(inspect.signature(getattr(DeltastoreWeightTransfer, name)).parameters)
        assert ours == theirs, (name, ours, theirs)
