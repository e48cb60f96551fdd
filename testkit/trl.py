"""TRL's ``AsyncGRPOTrainer`` on CPU, as the tests build it: examples/trl_grpo.py's tiny Qwen2
and word-level tokenizer, a prompt dataset, a reward of zero. Tests import TRL only through this
module's functions, after ``pytest.importorskip("trl")``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def trl_example() -> ModuleType:
    """examples/trl_grpo.py as a module (its tiny model, tokenizer and CPU patches)."""
    spec = importlib.util.spec_from_file_location("trl_grpo_example", ROOT / "examples" / "trl_grpo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_async_grpo(tmp_path: Path, *, steps: int, lr: float, rollout_worker: Any, weight_transfer: Any,
                    **config: Any) -> tuple[Any, ModuleType]:
    """``(trainer, example)``: an ``AsyncGRPOTrainer`` of ``steps`` optimizer steps at ``lr`` on
    the example's tiny model (built under ``tmp_path``), syncing weights every step; ``config``
    adds ``AsyncGRPOConfig`` fields."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    ex = trl_example()
    ex.run_trl_on_cpu()
    model_dir = ex.build_tiny_model(tmp_path / "model")
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=steps, learning_rate=lr, bf16=False, use_cpu=True,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, token_budget=64,
        weight_sync_steps=1, report_to="none", save_strategy="no", logging_steps=1, **config,
    )
    trainer = AsyncGRPOTrainer(
        model=str(model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "p"}]] * 4}),
        processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_worker=rollout_worker,
        weight_transfer=weight_transfer,
    )
    return trainer, ex
