"""Federated fine-tuning through object storage: N sites train locally, one aggregator merges.

A local S3 server (deltastore.devserver's moto server) holds one global store and one store per
site. The aggregator (this process) publishes all-MiniLM-L6-v2 in bf16 as global version 1.
Each round, every site (a separate process) fast-forwards to the global version, fine-tunes
its fp32 copy on its own share of the data for a few AdamW steps, and publishes its result as
a *based version* (only its change, against the global version, design 009) into its own
store. The aggregator waits for all sites, verifies each result, merges them (weighted average
in fp32 of the changes) and publishes the next global version as a delta.

    python examples/federated.py                     # 3 sites, 3 rounds
    python examples/federated.py --sites 2 --rounds 1 --steps 1

Per round it prints each site's bytes up and down and the aggregator's. The last stdout line is
one JSON object: rounds, sites, model_bytes, upload_bytes_per_site_round and
download_bytes_per_site_round (medians; download counts the fast-forwards after the first full
pull), bit_exact (every site's weights equal the global version it pulled, and every global
version equals the merge of the sites' results recomputed here, independently, from files the
sites wrote). Exit status 0 when bit-exact, 1 otherwise, 2 on bad arguments.

:func:`run` with ``args.link`` (a ``testkit.shaper.Link``, set by ``python -m
benchmarks.federated --far``) puts each site's S3 traffic and the aggregator's behind their own
link-shaping proxy, times every round, and runs the same rounds a second time as an exchange of
full safetensors checkpoints over the same links (see :func:`full_round`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from deltastore import WriterPolicy
from demo import (
    MAX_LEN,
    PAIRS,
    SIMILARITY_SCALE,
    WEIGHT_DECAY,
    DemoError,
    export_bf16,
    model_dir,
)
from worker import human_bytes, tensor_digests

logger = logging.getLogger("deltastore.examples.federated")

DEFAULT_SITES = 3
DEFAULT_ROUNDS = 3
#: Local AdamW steps per site per round (each on a batch of the site's own pairs).
DEFAULT_STEPS = 2
#: The demo's fine-tuning learning rate (RL-like, where bf16 changes are sparse).
DEFAULT_LR = 3e-6
#: Pairs per local step.
BATCH_SIZE = 8
#: Seconds to wait for a site's answer before the run is declared failed (model load included).
SITE_TIMEOUT_S = 600.0
SEED = 0
#: Where the full-checkpoint exchange keeps its files (next to the stores, same bucket).
FULL_PREFIX = "run/full"


# --- byte accounting ------------------------------------------------------------------------


def local_steps(model: Any, tokenizer: Any, opt: torch.optim.Optimizer, pairs: list[tuple[str, str]],
                weights: dict[str, torch.Tensor], rnd: int, steps: int) -> tuple[dict[str, torch.Tensor], float]:
    """A site's local training of round ``rnd``: ``model``'s fp32 masters start from the global
    bf16 ``weights``, then ``steps`` AdamW steps of the demo's contrastive loss on the round's
    batches of ``pairs``. Returns the bf16 export and the last loss."""
    def embed(texts: list[str]) -> torch.Tensor:
        enc = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LEN, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)

    with torch.no_grad():
        model.load_state_dict({n: t.to(torch.float32) if t.is_floating_point() else t for n, t in weights.items()})
    loss = torch.zeros(())
    for s in range(steps):
        start = ((rnd * steps + s) * BATCH_SIZE) % len(pairs)
        batch = [pairs[(start + i) % len(pairs)] for i in range(min(BATCH_SIZE, len(pairs)))]
        q, p = embed([a for a, _ in batch]), embed([b for _, b in batch])
        scores = SIMILARITY_SCALE * q @ p.T
        labels = torch.arange(len(batch))
        loss = (torch.nn.functional.cross_entropy(scores, labels) + torch.nn.functional.cross_entropy(scores.T, labels)) / 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return export_bf16(model), float(loss)


def count_bytes(store: Any) -> dict[str, int]:
    """Count the body bytes this process moves through ``store`` (reads and writes), by
    wrapping the instance's methods: what a site's link carries (requests' headers aside)."""
    counts = {"down": 0, "up": 0}
    get, get_meta, get_if, put = store.get, store.get_with_meta, store.get_if_changed, store.put

    def _get(key: str, **kw: Any) -> bytes:
        data = get(key, **kw)
        counts["down"] += len(data)
        return data

    def _get_meta(key: str) -> Any:
        res = get_meta(key)
        counts["down"] += len(res.data)
        return res

    def _get_if(key: str, etag: str | None) -> Any:
        res = get_if(key, etag)
        if res is not None:
            counts["down"] += len(res.data)
        return res

    def _put(key: str, data: bytes, **kw: Any) -> Any:
        counts["up"] += len(data)
        return put(key, data, **kw)

    store.get, store.get_with_meta, store.get_if_changed, store.put = _get, _get_meta, _get_if, _put
    return counts


# --- a site (its own process) ----------------------------------------------------------------


def site_main(index: int, n_sites: int, global_url: str, site_url: str, options: dict, lr: float, steps: int,
              out_dir: str, orders: Any, answers: Any) -> None:
    """Run rounds when told: pull, train ``steps`` AdamW steps on this site's pairs, publish."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    torch.set_num_threads(1)
    try:
        from safetensors.torch import save_file
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from deltastore.federated import Site
        from deltastore.storage import open_store

        hf_logging.disable_progress_bar()
        path = model_dir()
        torch.manual_seed(SEED + index)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModel.from_pretrained(str(path), dtype=torch.float32)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
        pairs = PAIRS[index::n_sites]  # each site trains on different data
        global_store = open_store(global_url, storage_options=options)
        site_store = open_store(site_url, storage_options=options)
        down, up = count_bytes(global_store), count_bytes(site_store)
        site = Site(global_url, site_url, dtype=torch.bfloat16, global_store=global_store, site_store=site_store,
                    writer_policy=WriterPolicy(threads=1, writer_id=f"site-{index}"))
        full_client = s3_client(options)
        answers.put({"site": index, "event": "ready"})

        def train(weights: dict[str, torch.Tensor], rnd: int) -> dict[str, torch.Tensor]:
            return local_steps(model, tokenizer, opt, pairs, weights, rnd, steps)[0]

        while True:
            order = orders.get()
            if order["do"] == "stop":
                break
            if order["do"] == "full":  # the baseline: fetch the global checkpoint, send the result
                t0 = time.monotonic()
                full_client.download_file(order["bucket"], order["global_key"], str(Path(out_dir) / f"global-site{index}"))
                t1 = time.monotonic()
                full_client.upload_file(str(Path(out_dir) / f"round{order['round']}-site{index}.safetensors"),
                                        order["bucket"], order["result_key"])
                answers.put({"site": index, "event": "full", "down_s": t1 - t0, "up_s": time.monotonic() - t1})
                continue
            d0, u0 = down["down"] + down["up"], up["down"] + up["up"]
            t0 = time.monotonic()
            base, _ = site.pull()
            pull_s = time.monotonic() - t0
            pulled = tensor_digests(site.weights)
            d1 = down["down"] + down["up"]
            if order["do"] == "final":
                answers.put({"site": index, "event": "final", "version": base.version, "digests": pulled, "down": d1 - d0})
                continue
            rnd = order["round"]
            t0 = time.monotonic()
            result = train({n: t.clone() for n, t in site.weights.items()}, rnd)
            train_s = time.monotonic() - t0
            save_file(result, str(Path(out_dir) / f"round{rnd}-site{index}.safetensors"))
            t0 = time.monotonic()
            info = site.publish_result(result, num_examples=len(pairs), step=rnd)  # FedAvg: weight by data size
            publish_s = time.monotonic() - t0
            answers.put({"site": index, "event": "round", "round": rnd, "base": base.version, "version": info.version,
                         "digests": pulled, "down": d1 - d0, "up": up["down"] + up["up"] - u0,
                         "packs_up": info.bytes_stored, "num_examples": len(pairs),
                         "pull_s": pull_s, "train_s": train_s, "publish_s": publish_s})
        site.close()
        global_store.close()
        site_store.close()
    except BaseException as e:
        answers.put({"site": index, "event": "error", "error": f"{type(e).__name__}: {e}"})
        raise


# --- the independent check ----------------------------------------------------------------------


def merge_check(base: dict[str, torch.Tensor], results: list[dict[str, torch.Tensor]], weights: list[float]
                ) -> dict[str, torch.Tensor]:
    """The merge of design 009 recomputed here without deltastore's code: per element, the
    base where no site changed its bits, else bf16(base + Σ w_i (site_i − base)) in fp32."""
    out = {}
    for n, b in base.items():
        if not b.is_floating_point():
            o = b.clone()
            for r in reversed(results):
                o = torch.where(r[n] != b, r[n], o)
            out[n] = o
            continue
        ib = b.view(torch.int16)
        unchanged = torch.ones(b.shape, dtype=torch.bool)
        acc = b.float().clone()
        for r, w in zip(results, weights):
            unchanged &= r[n].view(torch.int16) == ib
            acc += w * (r[n].float() - b.float())
        out[n] = torch.where(unchanged, b, acc.to(torch.bfloat16))
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(tensor_digests({n: a[n]}) == tensor_digests({n: b[n]}) for n in a)


# --- the full-checkpoint baseline -------------------------------------------------------------


def s3_client(options: dict) -> Any:
    """A plain boto3 client on ``options``' endpoint: its ``upload_file`` / ``download_file``
    (boto3's transfer manager: 8 MiB parts, 10 threads) are how full checkpoints move."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=options["endpoint_url"], aws_access_key_id=options["aws_access_key_id"],
                        aws_secret_access_key=options["aws_secret_access_key"], region_name=options["region_name"],
                        config=Config(s3={"addressing_style": "path"}))


def full_round(rnd: int, client: Any, bucket: str, orders: list[Any], answers: Any, base: dict[str, torch.Tensor],
               weights: list[float], out_dir: str) -> dict[str, Any]:
    """Round ``rnd`` as an exchange of full safetensors checkpoints, timed: every site downloads
    the global checkpoint and uploads its result (the file it saved this round), all at once;
    then the aggregator downloads every result, merges (:func:`merge_check`, the same merge) and
    uploads the next global checkpoint. Returns the times and the merged state."""
    from safetensors.torch import load_file, save_file

    n = len(orders)
    t0 = time.monotonic()
    for i, q in enumerate(orders):
        q.put({"do": "full", "round": rnd, "bucket": bucket, "global_key": f"{FULL_PREFIX}/global-{rnd}.safetensors",
               "result_key": f"{FULL_PREFIX}/round{rnd}-site{i}.safetensors"})
    done = wait_for(answers, n, "full")
    sites_s = time.monotonic() - t0
    t0 = time.monotonic()
    paths = [str(Path(out_dir) / f"agg-round{rnd}-site{i}.safetensors") for i in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:  # all sites' results at once, as deltastore's aggregator
        list(pool.map(lambda i: client.download_file(bucket, f"{FULL_PREFIX}/round{rnd}-site{i}.safetensors", paths[i]),
                      range(n)))
    down_s = time.monotonic() - t0
    t1 = time.monotonic()
    merged = merge_check(base, [load_file(p) for p in paths], [w / sum(weights) for w in weights])
    out = str(Path(out_dir) / f"global-{rnd + 1}.safetensors")
    save_file(merged, out)
    t2 = time.monotonic()
    client.upload_file(out, bucket, f"{FULL_PREFIX}/global-{rnd + 1}.safetensors")
    t3 = time.monotonic()
    return {"sites_s": sites_s, "site_down_s": [m["down_s"] for m in done], "site_up_s": [m["up_s"] for m in done],
            "agg_down_s": down_s, "agg_merge_s": t2 - t1, "agg_up_s": t3 - t2, "agg_s": t3 - t0, "merged": merged}


# --- the aggregator (this process) -------------------------------------------------------------


def wait_for(answers: Any, n: int, event: str) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + SITE_TIMEOUT_S
    while len(got) < n:
        msg = answers.get(timeout=max(1.0, deadline - time.monotonic()))
        if msg["event"] == "error":
            raise DemoError(f"site {msg['site']} failed: {msg['error']}")
        if msg["event"] == event:
            got.append(msg)
    return sorted(got, key=lambda m: m["site"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    from deltastore import Subscriber
    from deltastore.devserver import moto
    from deltastore.federated import Aggregator
    from deltastore.storage import open_store

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModel.from_pretrained(str(model_dir()), dtype=torch.float32)
    initial = export_bf16(model)
    del model
    model_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    ctx = multiprocessing.get_context("spawn")
    link = getattr(args, "link", None)
    with moto() as server, tempfile.TemporaryDirectory(prefix="federated-") as out_dir, \
            contextlib.ExitStack() as links:
        options = server.storage_options()
        # Each site and the aggregator reach S3 through a link of their own (or directly).
        shapers = []
        if link is not None:
            from testkit.shaper import LinkShaper

            shapers = [links.enter_context(LinkShaper(server.endpoint_url, link)) for _ in range(args.sites + 1)]
        reach = [server.with_endpoint(s.endpoint_url).storage_options() for s in shapers] or [options] * (args.sites + 1)
        site_options, agg_options = reach[:args.sites], reach[args.sites]
        global_url = server.url("run/global")
        site_urls = {f"site-{i}": server.url(f"run/sites/site-{i}") for i in range(args.sites)}
        orders = [ctx.Queue() for _ in range(args.sites)]
        answers = ctx.Queue()
        procs = [ctx.Process(target=site_main, name=f"site-{i}", daemon=True,
                             args=(i, args.sites, global_url, site_urls[f"site-{i}"], site_options[i], args.lr, args.steps,
                                   out_dir, orders[i], answers)) for i in range(args.sites)]
        for p in procs:
            p.start()
        global_store = open_store(global_url, storage_options=agg_options)
        agg_bytes = count_bytes(global_store)
        agg_client = s3_client(agg_options)
        timings: list[dict[str, Any]] = []
        uploads: list[int] = []
        downloads: list[int] = []
        checkpoints: list[int] = []
        bit_exact = True
        try:
            with Aggregator(global_url, site_urls, dtype=torch.bfloat16, global_store=global_store,
                            site_storage_options=agg_options, poll_interval_s=0.2,
                            writer_policy=WriterPolicy(writer_id="aggregator")) as agg:
                agg.start(initial)
                digests = {agg.version: tensor_digests(agg.state())}
                print(f"global version {agg.version}: {human_bytes(model_bytes)} model (bf16) published; "
                      f"{args.sites} sites, {args.rounds} rounds")
                wait_for(answers, args.sites, "ready")
                for rnd in range(args.rounds):
                    base_state = {n: t.clone() for n, t in agg.state().items()}
                    t_round = time.monotonic()
                    for q in orders:
                        q.put({"do": "round", "round": rnd})
                    done = wait_for(answers, args.sites, "round")
                    a0 = dict(agg_bytes)
                    t_agg = time.monotonic()
                    report = agg.run_round(step=rnd)
                    t_end = time.monotonic()
                    read = sum(o.bytes_read for o in report.sites)
                    files = [Path(out_dir) / f"round{rnd}-site{i}.safetensors" for i in range(args.sites)]
                    checkpoints.extend(f.stat().st_size for f in files)  # what exchanging full checkpoints moves
                    results = [load_file(str(f)) for f in files]
                    weights = [m["num_examples"] for m in done]
                    want = merge_check(base_state, results, [w / sum(weights) for w in weights])
                    with Subscriber(global_url, storage_options=options) as sub:
                        served = sub.pull(report.published.version)
                    merged_ok = same_bits(want, agg.state()) and same_bits(want, served)
                    pulled_ok = all(m["digests"] == digests[m["base"]] for m in done)
                    bit_exact &= merged_ok and pulled_ok
                    digests[report.published.version] = tensor_digests(agg.state())
                    if link is not None:
                        if rnd == 0:  # the initial global checkpoint, as agg.start published version 1
                            path = str(Path(out_dir) / "global-0.safetensors")
                            save_file(base_state, path)
                            agg_client.upload_file(path, server.bucket, f"{FULL_PREFIX}/global-0.safetensors")
                        full = full_round(rnd, agg_client, server.bucket, orders, answers, base_state, weights, out_dir)
                        full_ok = same_bits(want, full.pop("merged"))
                        bit_exact &= full_ok
                        train_s = max(m["train_s"] for m in done)
                        timings.append({
                            "round": rnd,
                            "deltastore": {"end_to_end_s": t_end - t_round, "sites_s": t_agg - t_round,
                                           "site_pull_s": [m["pull_s"] for m in done],
                                           "site_publish_s": [m["publish_s"] for m in done],
                                           "site_train_s": [m["train_s"] for m in done], "agg_s": t_end - t_agg},
                            # the sites' training is not repeated: its time in this round is added
                            "full": {**full, "end_to_end_s": full["sites_s"] + train_s + full["agg_s"],
                                     "merge_bit_exact": full_ok},
                        })
                        print(f"round {rnd} time: deltastore {t_end - t_round:.1f} s end to end (aggregator "
                              f"{t_end - t_agg:.1f} s), full checkpoints {timings[-1]['full']['end_to_end_s']:.1f} s "
                              f"(aggregator {full['agg_s']:.1f} s)")
                    for m in done:
                        uploads.append(m["up"])
                        if rnd > 0:  # round 0's pull is the first full download of the model
                            downloads.append(m["down"])
                        print(f"round {rnd} site-{m['site']}: down {human_bytes(m['down'])}, up {human_bytes(m['up'])} "
                              f"({100 * m['up'] / model_bytes:.2f}% of the model)")
                    print(f"round {rnd} aggregator: read {human_bytes(read)} from sites, published version "
                          f"{report.published.version} ({human_bytes(agg_bytes['up'] - a0['up'])} up, "
                          f"{report.published.elements_changed} elements changed); merge bit-exact {merged_ok}, "
                          f"sites on the global version {pulled_ok}")
                for q in orders:
                    q.put({"do": "final"})
                final = wait_for(answers, args.sites, "final")
                for m in final:
                    downloads.append(m["down"])
                    bit_exact &= m["version"] == agg.version and m["digests"] == digests[agg.version]
                print(f"final: every site at global version {agg.version}: "
                      f"{all(m['version'] == agg.version for m in final)}")
        finally:
            for q in orders:
                q.put({"do": "stop"})
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
    return {
        "rounds": args.rounds,
        "sites": args.sites,
        "model_bytes": model_bytes,
        "upload_bytes_per_site_round": statistics.median(uploads),
        "download_bytes_per_site_round": statistics.median(downloads),
        "full_checkpoint_bytes": statistics.median(checkpoints),
        "upload_fraction": round(statistics.median(uploads) / model_bytes, 5),
        "download_fraction": round(statistics.median(downloads) / model_bytes, 5),
        "bit_exact": bit_exact,
        **({"link": dataclasses.asdict(link), "timings": timings,
            # what crossed each link (sites', then the aggregator's), request headers included
            "link_bytes": [{"up": s.bytes_up, "down": s.bytes_down} for s in shapers]} if link is not None else {}),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=DEFAULT_SITES)
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="local AdamW steps per site per round")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.sites < 1 or args.rounds < 1 or args.steps < 1:
        ap.error("--sites, --rounds and --steps must be ≥ 1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(processName)s %(name)s: %(message)s")
    try:
        out = run(args)
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0 if out["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
