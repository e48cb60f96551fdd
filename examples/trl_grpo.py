"""TRL asynchronous GRPO on CPU, with weights shipped to the rollout worker through deltastore.

    python examples/trl_grpo.py [--steps 4] [--store DIR]

The trainer is TRL's own ``AsyncGRPOTrainer`` (trl ≥ 1.16) with
``weight_transfer=DeltastoreWeightTransfer(store)``: after every optimizer step it publishes the
policy (fp32 masters served as bf16) as a version in a local store, in the background. The
rollout worker (a ``RolloutWorkerProtocol`` implementation, below) follows that store in a
thread, swaps each new version into its own copy of the model under a lock it also holds while
generating, generates groups of completions, scores them and tags every sample with the
``model_version`` it was generated with (read from the version's metadata, not assumed).

Everything runs on CPU with a tiny Qwen2 built from a config and a word-level tokenizer made on
the spot (nothing is downloaded). Two things TRL cannot do without a GPU are replaced here, and
only these (``run_trl_on_cpu``): its tree-packing attention calls a FlashAttention-3 kernel
(``_flash_attn``), which is given a CPU implementation (``scaled_dot_product_attention`` per
packed segment), and its MFU metric asks CUDA for the device name (answered "unknown"). There
is no vLLM server, so the rollout worker generates with transformers.

At the end it checks that the worker's weights are bit-identical to the trainer's, cast to bf16.
"""

from __future__ import annotations

import argparse
import logging
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: The words of the toy task's vocabulary; the reward is the fraction of completion words that
#: are "yes", so a policy that learns says "yes".
WORDS = ["yes", "no", "maybe", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m"]
SPECIALS = ["<pad>", "<eos>", "<unk>", "<user>", "<assistant>"]


def build_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """A tiny Qwen2 (tied embeddings, 2 layers) and a word-level tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
    )
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"], bos_token_id=vocab["<eos>"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = vocab["<eos>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def varlen_attention_cpu(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True, window_size=(-1, -1), **_):
    """FlashAttention's ``flash_attn_varlen_func`` on CPU: causal attention per packed segment,
    the queries aligned with the end of their keys (as flash-attn does when they differ)."""
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("sliding windows are not needed by this example's model")
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qs = q[qa:qb].transpose(0, 1)
        ks = k[ka:kb].transpose(0, 1).repeat_interleave(groups, 0)
        vs = v[ka:kb].transpose(0, 1).repeat_interleave(groups, 0)
        mask = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril(diagonal=(kb - ka) - (qb - qa)) if causal else None
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)
        out[qa:qb] = o.transpose(0, 1)
    return out


def run_trl_on_cpu() -> None:
    """Patch the two things TRL's async GRPO trainer cannot do without a GPU, and only those:
    its tree-packing attention gets a CPU kernel instead of FlashAttention-3, and the MFU
    metric's peak-FLOPs lookup (which asks CUDA for the device name) says "unknown" (None)."""
    from types import SimpleNamespace

    from trl.experimental.async_grpo import async_grpo_trainer, packing

    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention_cpu)
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None



def queue_group(buffer: queue.Queue, stop: threading.Event, prompt: list, prompt_ids: list[int], out: torch.Tensor,
                logp: torch.Tensor, tokenizer, *, reward_token: int, model_version: int, group_id: int) -> None:
    """Put one generated group into TRL's rollout buffer as ``RolloutSample``s: ``out`` are the
    sequences (prompt then completion), ``logp`` their token log-probabilities; the reward is the
    fraction of ``reward_token`` in a completion, the advantage its group-normalized value. Waits
    for room unless ``stop`` is set."""
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    completions = out[:, len(prompt_ids):]
    rewards = (completions == reward_token).float().mean(dim=1).numpy()
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    for j in range(out.shape[0]):
        comp = completions[j].tolist()
        n = len(prompt_ids) + len(comp)
        old = np.zeros(n, dtype=np.float32)
        old[len(prompt_ids):] = logp[j, len(prompt_ids) - 1: n - 1].numpy()
        sample = RolloutSample(
            prompt=prompt, completion=[{"role": "assistant", "content": tokenizer.decode(comp)}],
            input_ids=np.array(prompt_ids + comp, dtype=np.int64),
            completion_mask=np.array([0] * len(prompt_ids) + [1] * len(comp), dtype=np.int64),
            old_log_probs=old, advantage=float(adv[j]), model_version=model_version, group_id=group_id,
            metrics={"reward": float(rewards[j])},
        )
        while not stop.is_set():
            try:
                buffer.put(sample, timeout=0.1)
                break
            except queue.Full:
                continue

class DeltastoreRolloutWorker:
    """A TRL ``RolloutWorkerProtocol`` that serves the policy it follows from a deltastore.

    A thread follows the store (``Subscriber.follow``) and swaps each version into the worker's
    model under ``lock``; the generation thread holds ``lock`` while it generates a group, so
    generation pauses only for the swap. Samples carry the ``model_version`` of the weights that
    generated them (the version's metadata, written by ``DeltastoreWeightTransfer``).
    """

    def __init__(self, url: str, model_dir: Path, prompts: list[str], *, num_generations: int = 4,
                 max_new_tokens: int = 6, queue_maxsize: int = 64, seed: int = 0):
        self.url, self.model_dir, self.prompts = url, model_dir, prompts
        self.num_generations, self.max_new_tokens, self.seed = num_generations, max_new_tokens, seed
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.served_version = 0  # TRL's model_version of the weights being served
        self.trainer_version = 0  # what the trainer last told us
        self.versions_applied: list[int] = []
        self.weights: dict[str, torch.Tensor] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._last_beat = time.monotonic()

    def start(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from deltastore import Subscriber

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.bfloat16).eval()
        # The store holds what TRL sends: named_parameters(), so the tied lm_head is not in it.
        self.weights = {n: p.data for n, p in self.model.named_parameters()}
        self.sub = Subscriber(self.url, threads=1)
        first = threading.Event()
        self._threads = [
            threading.Thread(target=self._guard, args=(self._follow, first), name="follow", daemon=True),
            threading.Thread(target=self._guard, args=(self._generate, first), name="generate", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _guard(self, fn: Any, first: threading.Event) -> None:
        try:
            fn(first)
        except BaseException as e:  # noqa: BLE001 - reported by check_health
            self._error = e
            first.set()

    def _follow(self, first: threading.Event) -> None:
        from deltastore import PollPolicy

        for rec in self.sub.follow(self.weights, poll=PollPolicy(0.05), pause=self.lock, stop=self._stop, heartbeat=None):
            self.served_version = int(rec.info.metadata.get("model_version", rec.info.version))
            self.versions_applied.append(self.served_version)
            first.set()

    @torch.no_grad()
    def _generate(self, first: threading.Event) -> None:
        first.wait()
        rng = np.random.default_rng(self.seed)
        yes = self.tokenizer.convert_tokens_to_ids("yes")
        group_id = 0
        while not self._stop.is_set():
            text = self.prompts[group_id % len(self.prompts)]
            prompt = [{"role": "user", "content": text}]
            prompt_ids = self.tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
            with self.lock:  # the follow thread swaps only between groups
                version = self.served_version
                torch.manual_seed(int(rng.integers(1 << 31)))
                ids = torch.tensor([prompt_ids] * self.num_generations)
                out = self.model.generate(ids, do_sample=True, max_new_tokens=self.max_new_tokens, temperature=1.0,
                                          top_k=0, top_p=1.0, attention_mask=torch.ones_like(ids))
                logits = self.model(out).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, out[:, 1:, None])[..., 0]
            queue_group(self.rollout_buffer, self._stop, prompt, prompt_ids, out, logp, self.tokenizer,
                        reward_token=yes, model_version=version, group_id=group_id)
            self._last_beat = time.monotonic()
            group_id += 1

    def update_model_version(self, model_version: int) -> None:
        self.trainer_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout worker failed: {self._error!r}") from self._error
        if time.monotonic() - self._last_beat > stale_after_s:
            raise RuntimeError(f"the rollout worker produced nothing for {stale_after_s} s")

    def stop(self) -> None:
        """Stop generating and following (the Subscriber stays open: see close)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def close(self) -> None:
        if getattr(self, "sub", None) is not None:
            self.sub.close()


def run(store: str, work: Path, *, steps: int, lr: float = 1e-3, log: bool = True) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; returns what happened (for the test)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from deltastore import Subscriber
    from deltastore.integrations.trl import DeltastoreWeightTransfer

    run_trl_on_cpu()
    model_dir = build_tiny_model(work / "tiny-qwen2")
    prompts = ["say yes", "a b c", "yes or no", "maybe"]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    args = AsyncGRPOConfig(
        output_dir=str(work / "out"), max_steps=steps, learning_rate=lr, bf16=False, use_cpu=True,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, token_budget=256,
        weight_sync_steps=1, max_staleness=4, logging_steps=1, report_to="none", save_strategy="no",
        vllm_server_timeout=60.0, heartbeat_stale_after_s=120.0,
    )
    backend = DeltastoreWeightTransfer(store, dtype=torch.bfloat16, metadata={"run": "trl_grpo example"},
                                       tied_weights={"lm_head.weight": "model.embed_tokens.weight"})
    worker = DeltastoreRolloutWorker(store, model_dir, prompts, num_generations=4)
    trainer = AsyncGRPOTrainer(
        model=str(model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
        train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir),
        rollout_worker=worker, weight_transfer=backend,
    )
    trainer.train()  # ends with destroy(): every version is committed (or the failure raised)
    sent = {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()}
    with Subscriber(store, threads=1) as sub:
        log_ = sub.log()
        final = sub.pull()
    trained_bitexact = set(final) == set(sent) and all(torch.equal(final[n], sent[n]) for n in sent)
    # The worker stopped with train(), maybe before the last version: its own subscriber
    # fast-forwards it from the version it holds (a delta, checked against every digest).
    worker.sub.pull_into(worker.weights)
    worker.close()
    worker_bitexact = all(torch.equal(worker.weights[n], sent[n]) for n in sent)
    result = {
        "versions": [(i.version, i.kind, i.bytes_stored, i.metadata.get("model_version")) for i in log_],
        "trainer_model_version": trainer.model_version,
        "worker_applied": worker.versions_applied,
        "trained_bitexact": trained_bitexact,
        "worker_bitexact": worker_bitexact,
        "tied_weights": log_[-1].metadata.get("tied_weights"),
    }
    if log:
        for v, kind, nbytes, mv in result["versions"]:
            print(f"version {v:3d}  {kind:6s}  {nbytes:8d} bytes  model_version {mv}")
        print(f"worker applied model versions {worker.versions_applied}")
        print(f"store head == trainer weights (bf16): {trained_bitexact}; worker bit-identical: {worker_bitexact}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--store", help="store URL or directory (default: a temporary directory)")
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = run(a.store or str(work / "store"), work, steps=a.steps, lr=a.lr)
    return 0 if result["trained_bitexact"] and result["worker_bitexact"] else 1


if __name__ == "__main__":
    sys.exit(main())
