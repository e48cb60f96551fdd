"""DeltastoreCallback with a real transformers.Trainer on a tiny model, on CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deltastore import Subscriber

# Checked, not imported: transformers' Trainer (and what it imports) costs seconds in every
# process that collects the suite; the tests import it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers (pip install 'deltastore-weights[transformers]')")


def _callback(*args, **kwargs):
    from deltastore.integrations.transformers import DeltastoreCallback

    return DeltastoreCallback(*args, **kwargs)


def _tiny_lm():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _recorder():
    """A callback that records the weights at each on_step_end and how often each hook fired."""
    from transformers import TrainerCallback

    class _Recorder(TrainerCallback):
        def __init__(self):
            self.weights: dict[int, dict[str, torch.Tensor]] = {}
            self.optimizer_steps = 0

        def on_optimizer_step(self, args, state, control, **kw):
            self.optimizer_steps += 1

        def on_step_end(self, args, state, control, model=None, **kw):
            self.weights[state.global_step] = {n: t.detach().clone() for n, t in model.state_dict().items()}

    return _Recorder()


def _trainer(tmp_path, callbacks, **kw):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", save_strategy="no",
                             per_device_train_batch_size=4, learning_rate=1e-2, logging_strategy="no",
                             disable_tqdm=True, **kw)
    return Trainer(model=_tiny_lm(), args=args, train_dataset=_Data(), callbacks=callbacks)


def test_callback_publishes_each_optimizer_step_bit_exact(tmp_path) -> None:
    url = str(tmp_path / "store")
    cb, rec = _callback(url, every_n_steps=1), _recorder()
    trainer = _trainer(tmp_path, [cb, rec], max_steps=4, gradient_accumulation_steps=2)
    trainer.train()
    assert cb.publisher is None  # closed at train end, after every version committed
    with Subscriber(url, threads=1) as sub:
        log = sub.log()
        assert [i.step for i in log] == [1, 2, 3, 4]  # once per optimizer step, not per micro-batch
        assert [i.metadata["global_step"] for i in log] == [1, 2, 3, 4]
        assert log[0].metadata["tied_weights"] == {"lm_head.weight": "model.embed_tokens.weight"}
        for info in log:
            got = sub.pull(info.version)
            want = rec.weights[info.step]
            assert "lm_head.weight" not in got
            for n, t in got.items():
                assert t.dtype == torch.bfloat16
                assert torch.equal(t, want[n].to(torch.bfloat16)), (info.step, n)
            # the worker re-ties: load into a fresh model, strict=False, the tie carries the head
            model = _tiny_lm().to(torch.bfloat16)
            missing, unexpected = model.load_state_dict(got, strict=False)
            assert set(missing) <= {"lm_head.weight"} and not unexpected
            assert torch.equal(model.lm_head.weight, want["model.embed_tokens.weight"].to(torch.bfloat16))
    # the versions after the first differ from each other (training moved the weights)
    assert not torch.equal(rec.weights[1]["model.norm.weight"], rec.weights[4]["model.norm.weight"]) or \
        not torch.equal(rec.weights[1]["model.embed_tokens.weight"], rec.weights[4]["model.embed_tokens.weight"])


def test_every_n_steps_and_final_publish(tmp_path) -> None:
    url = str(tmp_path / "store")
    cb = _callback(url, every_n_steps=2, dtype=None)
    _trainer(tmp_path, [cb], max_steps=5).train()
    with Subscriber(url, threads=1) as sub:
        log = sub.log()
        assert [i.step for i in log] == [2, 4, 5]  # and the last step, at train end
        assert sub.pull()["model.embed_tokens.weight"].dtype == torch.float32  # dtype=None keeps it


def test_only_rank_zero_publishes(tmp_path) -> None:
    from transformers import TrainerControl, TrainerState

    url = tmp_path / "store"
    cb = _callback(str(url))
    state = TrainerState()
    state.is_world_process_zero, state.global_step = False, 1
    model = _tiny_lm()
    cb.on_train_begin(None, state, TrainerControl())
    cb.on_step_end(None, state, TrainerControl(), model=model)
    cb.on_train_end(None, state, TrainerControl(), model=model)
    assert cb.publisher is None and not cb.futures and not url.exists()
    with pytest.raises(ValueError):
        _callback(str(url), every_n_steps=0)


def test_import_deltastore_imports_no_framework() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, deltastore, deltastore.read.changes; "
            "print(sorted(m for m in ('trl', 'transformers', 'vllm', 'accelerate', 'deltastore.integrations') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert out.stdout.strip() == "[]"


def test_background_failure_stops_training_at_the_next_step(tmp_path) -> None:
    from transformers import TrainerControl, TrainerState

    from deltastore import Publisher
    from deltastore.errors import FencedError

    url = str(tmp_path / "store")
    cb, model, control = _callback(url), _tiny_lm(), TrainerControl()
    state = TrainerState()
    state.is_world_process_zero = True
    cb.on_train_begin(None, state, control)
    state.global_step = 1
    cb.on_step_end(None, state, control, model=model)
    cb.futures[-1].result(timeout=60)
    Publisher(url).close()  # another trainer took the store over
    state.global_step = 2
    cb.on_step_end(None, state, control, model=model)  # queued; fails in the background
    with pytest.raises(FencedError):
        cb.futures[-1].result(timeout=60)
    state.global_step = 3
    with pytest.raises(FencedError):
        cb.on_step_end(None, state, control, model=model)  # reported once, at the next step
    cb.on_train_end(None, state, control)  # closes; the failure is not raised twice
    assert cb.publisher is None
