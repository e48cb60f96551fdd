"""The compressed tier of federated rounds against lossless rounds: bytes up and held-out loss.

    python -m benchmarks.federated_compressed [--sites 2 --rounds 6 --steps 2 --lr 2e-5
                                               --density 0.014 --bits 2]

Model and task: all-MiniLM-L6-v2 (22.7M parameters), full-parameter fine-tuning with fp32
masters and AdamW (default betas, no weight decay), on masked-token reconstruction through the
tied word embeddings (:mod:`benchmarks.workload`'s objective and real-English corpus), batch 16 ×
32 tokens. The corpus is cut into a held-out slice (the last :data:`HELDOUT` sentences, masked
once with a fixed seed) and one training shard per site.

Each round every site pulls the bf16 global version, loads it into its fp32 masters, takes
``--steps`` AdamW steps on its shard (its optimizer's moments kept across rounds) and publishes
its result; the aggregator (``Aggregator``, weights = examples per site) merges and publishes
the next global version. The same rounds run twice with the same seeds, in one process, over
``file://`` stores:

- ``lossless``: each site publishes its bf16 export (the default);
- ``compressed``: each site publishes through ``Compression(density, bits)`` from its fp32
  masters, keeping its error feedback; the aggregator accepts compressed results.

Reported per run: bytes up per site-round (the site version's packs plus its manifest), as a
fraction of the bf16 model, and the held-out loss of every global version (the initial one
first), with the final ratio compressed / lossless. Goals: compressed up ≤ 1 % of the bf16
model per site-round, final held-out loss within 2 % of the lossless run's. Every global
version is checked bit-exact against a pull. Results: benchmarks/results/federated-compressed
.{json,md,svg}.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import BATCH_SIZE, MASK_PROB, SEED, SEQ_LEN, benchmark_process, tied_mlm_loss

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results"
UPLOAD_GOAL = 0.01
LOSS_GOAL = 0.02
#: Sentences held out of every site's training, to score global versions on.
HELDOUT = 256
THREADS = 2


def _data(n_sites: int) -> tuple[Any, list[list[dict[str, Any]]], dict[str, torch.Tensor]]:
    """The tokenizer's masking collator, one training shard per site, and the held-out batch
    (masked once, with a fixed seed)."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    from benchmarks.workload import corpus, model_dir

    tok = AutoTokenizer.from_pretrained(str(model_dir()))
    enc = tok(corpus(), padding="max_length", truncation=True, max_length=SEQ_LEN)
    rows = [{"input_ids": i, "attention_mask": m} for i, m in zip(enc["input_ids"], enc["attention_mask"])]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED)).tolist()
    held, train = [rows[i] for i in order[:HELDOUT]], [rows[i] for i in order[HELDOUT:]]
    collate = DataCollatorForLanguageModeling(tok, mlm_probability=MASK_PROB)
    torch.manual_seed(SEED)
    heldout = collate(held)
    return collate, [train[i::n_sites] for i in range(n_sites)], heldout


def _mlm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return tied_mlm_loss(hidden, batch["labels"], model.get_input_embeddings().weight)


def heldout_loss(model: Any, state: dict[str, torch.Tensor], heldout: dict[str, torch.Tensor]) -> float:
    with torch.no_grad():
        model.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t for n, t in state.items()})
        model.eval()
        return float(_mlm_loss(model, heldout))


def run(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One federated run (``lossless`` or ``compressed``); the same seeds either way."""
    from transformers import AutoModel

    from benchmarks.workload import model_dir
    from deltastore import Subscriber, WriterPolicy
    from deltastore.federated import Aggregator, Compression, ResultPolicy, Site
    from deltastore.format.history import History
    from deltastore.storage import open_store

    collate, shards, heldout = _data(args.sites)
    torch.manual_seed(SEED)
    scorer = AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32)
    initial = {n: t.to(torch.bfloat16) if t.is_floating_point() else t.clone() for n, t in scorer.state_dict().items()}
    model_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    global_url = f"file://{root}/{mode}/global"
    urls = {f"site-{i}": f"file://{root}/{mode}/sites/site-{i}" for i in range(args.sites)}
    comp = Compression(density=args.density, bits=args.bits) if mode == "compressed" else None
    policy = WriterPolicy(threads=THREADS)
    ups: list[float] = []
    curve: list[float] = []
    exact = True
    with Aggregator(global_url, urls, dtype=torch.bfloat16, results=ResultPolicy(accept_compressed=comp is not None),
                    writer_policy=policy) as agg:
        agg.start(initial)
        curve.append(heldout_loss(scorer, agg.state(), heldout))
        sites, models, opts = [], [], []
        for i, url in enumerate(urls.values()):
            sites.append(Site(global_url, url, dtype=torch.bfloat16, writer_policy=policy, compression=comp))
            torch.manual_seed(SEED + i)
            m = AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32)
            m.train()
            models.append(m)
            opts.append(torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0))
        try:
            for rnd in range(args.rounds):
                for i, (site, m, opt) in enumerate(zip(sites, models, opts)):
                    site.pull()
                    with torch.no_grad():
                        m.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t
                                           for n, t in site.weights.items()})
                    m.train()
                    g = torch.Generator().manual_seed(SEED + 1000 * rnd + i)
                    shard = shards[i]
                    for _ in range(args.steps):
                        idx = torch.randint(0, len(shard), (BATCH_SIZE,), generator=g).tolist()
                        torch.manual_seed(SEED + 7 * rnd + 13 * i)  # the collator's masks: the same in both runs
                        loss = _mlm_loss(m, collate([shard[j] for j in idx]))
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                    # lossless: the site's Site casts the fp32 masters to bf16; compressed: the
                    # compressor takes its change from the fp32 masters
                    info = site.publish_result(m.state_dict(), num_examples=len(shard))
                    with open_store(urls[f"site-{i}"]) as st:
                        manifest = st.get(info.manifest)
                    ups.append((info.bytes_stored + len(manifest)) / model_bytes)
                report = agg.run_round()
                curve.append(heldout_loss(scorer, agg.state(), heldout))
                logger.info("%s round %d: version %d, up %.3f %%, held-out loss %.4f", mode, rnd + 1,
                            report.published.version, 100 * statistics.median(ups[-args.sites:]), curve[-1])
            with Subscriber(global_url) as sub:
                got = sub.pull(agg.version)
            exact = got.keys() == agg.state().keys() and all(
                torch.equal(got[n].reshape(-1).view(torch.uint8), agg.state()[n].reshape(-1).view(torch.uint8))
                for n in got)
            history = History(open_store(global_url))
            head = history.read_head()[0]
            compressed_meta = history.head_manifest(head)[1].metadata["federated"].get("compressed")
        finally:
            for s in sites:
                s.close()
    return {"mode": mode, "upload_fraction_per_site_round": statistics.median(ups), "upload_fractions": ups,
            "heldout_curve": curve, "bit_exact": exact, "model_bytes": model_bytes,
            "global_names_compressed": bool(compressed_meta) if comp is not None else None}


def markdown(doc: dict[str, Any]) -> str:
    lossless, compressed = doc["lossless"], doc["compressed"]
    rows = ["| round | lossless held-out loss | compressed held-out loss | ratio |", "|---:|---:|---:|---:|"]
    for r, (a, b) in enumerate(zip(lossless["heldout_curve"], compressed["heldout_curve"])):
        rows.append(f"| {r} | {a:.4f} | {b:.4f} | {b / a:.4f} |")
    return "\n".join([
        f"Compressed tier: top {100 * doc['density']:g} % of each tensor's change, {doc['bits']} bits, error feedback; "
        f"{doc['sites']} sites, {doc['rounds']} rounds of {doc['steps']} AdamW steps at lr {doc['lr']:g}, seed {SEED}.",
        "",
        "| run | up per site-round (of the bf16 model) | final held-out loss | bit-exact |",
        "|---|---:|---:|---|",
        f"| lossless | {100 * lossless['upload_fraction_per_site_round']:.2f} % | {lossless['heldout_curve'][-1]:.4f} | "
        f"{lossless['bit_exact']} |",
        f"| compressed | {100 * compressed['upload_fraction_per_site_round']:.2f} % | "
        f"{compressed['heldout_curve'][-1]:.4f} ({100 * (doc['heldout_ratio'] - 1):+.2f} %) | {compressed['bit_exact']} |",
        "",
        *rows,
        "",
    ])


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for mode, colour, marker in (("lossless", "#0072B2", "o"), ("compressed", "#E69F00", "s")):
        r = doc[mode]
        ax.plot(range(len(r["heldout_curve"])), r["heldout_curve"], marker=marker, color=colour,
                label=f"{mode}: up {100 * r['upload_fraction_per_site_round']:.2f} % of the model per site-round")
    ax.set_xlabel("round (0: the initial global version)")
    ax.set_ylabel(f"held-out masked-token loss ({HELDOUT} sentences)")
    ax.set_title(f"all-MiniLM-L6-v2, {doc['sites']} sites, {doc['steps']} AdamW steps/round at lr {doc['lr']:g}; "
                 f"compressed: top {100 * doc['density']:g} %, {doc['bits']} bits, error feedback", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2, help="local AdamW steps per site per round")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--density", type=float, default=0.014)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "federated-compressed.json")
    args = ap.parse_args(argv)
    benchmark_process(THREADS)
    with tempfile.TemporaryDirectory(prefix="federated-compressed-") as tmp:
        lossless = run("lossless", args, Path(tmp))
        compressed = run("compressed", args, Path(tmp))
    ratio = compressed["heldout_curve"][-1] / lossless["heldout_curve"][-1]
    doc = {"sites": args.sites, "rounds": args.rounds, "steps": args.steps, "lr": args.lr, "density": args.density,
           "bits": args.bits, "seed": SEED, "heldout_sentences": HELDOUT, "lossless": lossless, "compressed": compressed,
           "heldout_ratio": ratio,
           "goals": {"upload_le_1pct": compressed["upload_fraction_per_site_round"] <= UPLOAD_GOAL,
                     "heldout_within_2pct": abs(ratio - 1) <= LOSS_GOAL}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(doc))
    plot(doc, args.out.with_suffix(".svg"))
    print(markdown(doc))
    print(json.dumps({"upload_fraction": compressed["upload_fraction_per_site_round"],
                      "lossless_upload_fraction": lossless["upload_fraction_per_site_round"],
                      "heldout_ratio": ratio, "goals": doc["goals"],
                      "bit_exact": lossless["bit_exact"] and compressed["bit_exact"]}))
    return 0 if all(doc["goals"].values()) and lossless["bit_exact"] and compressed["bit_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
