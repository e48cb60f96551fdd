"""LoRA rounds (deltastore.federated.lora): fedavg is the per-tensor weighted average, stack
folds the exact weighted sum of the sites' updates into the base, and an aggregator round with
a LoRA state merge publishes exactly what the merge computes."""

from __future__ import annotations

import math

import pytest
import torch

from deltastore import Subscriber
from deltastore.errors import InvalidStateDictError
from deltastore.federated import Aggregator, Site, weighted_average
from deltastore.federated.lora import LoraMerge, adapter_state, lora_modules
from deltastore.federated.merge import bit_pattern
from testkit.tensors import assert_bits_equal

P = "base_model.model.layer"
#: Two adapted modules of different shapes (out × in), rank 4, and one module no adapter touches.
SHAPES = {"q": (12, 8), "v": (6, 8)}
RANK = 4
SCALING = 16 / RANK


def peft_state(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A PeftModel's state_dict() in miniature: base weights under ``base_layer``, A random, B zero."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for m, (o, i) in SHAPES.items():
        out[f"{P}.{m}.base_layer.weight"] = torch.randn(o, i, generator=g) * 0.1
        out[f"{P}.{m}.base_layer.bias"] = torch.randn(o, generator=g) * 0.1
        out[f"{P}.{m}.lora_A.default.weight"] = torch.randn(RANK, i, generator=g) * 0.1
        out[f"{P}.{m}.lora_B.default.weight"] = torch.zeros(o, RANK)
    out[f"{P}.k.weight"] = torch.randn(12, 8, generator=g) * 0.1
    return {n: t.to(dtype) for n, t in out.items()}


def site_change(base: dict[str, torch.Tensor], seed: int, modules: tuple[str, ...] = ("q", "v")) -> dict[str, torch.Tensor]:
    """What a site's adapter training changes: A and B of ``modules``, whole tensors."""
    g = torch.Generator().manual_seed(100 + seed)
    out = {}
    for m in modules:
        for part in ("lora_A", "lora_B"):
            n = f"{P}.{m}.{part}.default.weight"
            out[n] = (base[n].float() + torch.randn(base[n].shape, generator=g) * 0.05).to(base[n].dtype)
    return out


def effective(state: dict[str, torch.Tensor], m: str) -> torch.Tensor:
    """W + s · B A of module ``m``, in fp64 (the reference)."""
    w, a, b = (state[f"{P}.{m}.{x}"].double() for x in ("base_layer.weight", "lora_A.default.weight", "lora_B.default.weight"))
    return w + SCALING * (b @ a)


def test_fedavg_is_the_weighted_average_of_each_changed_tensor() -> None:
    base = peft_state()
    sites = [site_change(base, 0), site_change(base, 1, ("q",))]
    weights = [0.7, 0.3]
    got = LoraMerge()(base, sites, weights)
    assert set(got) == set(sites[0])  # every changed A and B; nothing else
    for n, t in got.items():
        want = weighted_average(n, base[n], [s.get(n, base[n]) for s in sites], weights)
        assert_bits_equal({n: t}, {n: want})
    # v's factors moved at one site only: with weight 0.7, not copied whole
    n = f"{P}.v.lora_B.default.weight"
    assert torch.allclose(got[n], 0.7 * sites[0][n], atol=1e-7)


def test_stack_folds_the_exact_weighted_sum_into_the_base() -> None:
    base = peft_state()
    base[f"{P}.q.lora_B.default.weight"] = torch.randn(12, RANK) * 0.05  # a global B already nonzero
    sites = [site_change(base, 0), site_change(base, 1, ("q",)), site_change(base, 2)]
    w = f"{P}.v.base_layer.weight"
    sites[2][w] = base[w] + 0.01  # a site whose base was not frozen: its weight is part of its model
    weights = [0.5, 0.3, 0.2]
    got = LoraMerge("stack", scaling=SCALING)(base, sites, weights)
    new = {**base, **got}
    for m in SHAPES:
        want = sum(w * effective({**base, **s}, m) for s, w in zip(sites, weights))
        assert torch.allclose(effective(new, m), want, rtol=0, atol=1e-5), m
        assert not new[f"{P}.{m}.lora_B.default.weight"].any()
        assert f"{P}.{m}.lora_A.default.weight" not in got  # A stays the round's
    assert set(got) == {f"{P}.{m}.base_layer.weight" for m in SHAPES} | {f"{P}.q.lora_B.default.weight"}
    # the stacked product is not FedAvg: averaging A and B separately misses the cross terms
    avg = {**base, **LoraMerge()(base, sites, weights)}
    want_q = sum(w * effective({**base, **s}, "q") for s, w in zip(sites, weights))
    assert (effective(avg, "q") - want_q).abs().max() > 1e-4


def test_stack_leaves_untouched_modules_and_averages_other_tensors() -> None:
    base = peft_state()
    bias = f"{P}.q.base_layer.bias"
    one = {**site_change(base, 0, ("q",)), bias: base[bias] + 1.0}
    got = LoraMerge("stack", scaling=SCALING)(base, [one, {}], [0.5, 0.5])
    assert f"{P}.v.base_layer.weight" not in got and f"{P}.k.weight" not in got
    assert_bits_equal({bias: got[bias]}, {bias: weighted_average(bias, base[bias], [one[bias], base[bias]], [0.5, 0.5])})


def test_stack_in_bf16_casts_once() -> None:
    base = peft_state(dtype=torch.bfloat16)
    sites = [site_change(base, 0), site_change(base, 1)]
    got = LoraMerge("stack", scaling=SCALING)(base, sites, [0.5, 0.5])
    w = f"{P}.q.base_layer.weight"
    exact = sum(0.5 * effective({**base, **s}, "q") for s in sites)
    assert got[w].dtype == torch.bfloat16
    # within half a bf16 ulp of the exact fp32 result, element by element
    assert ((got[w].double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-12).all()


def test_stack_with_transposed_base_weights() -> None:
    base = peft_state()
    for m in SHAPES:  # GPT-2's Conv1D stores W as in × out
        n = f"{P}.{m}.base_layer.weight"
        base[n] = base[n].T.contiguous()
    sites = [site_change(base, 0)]
    with pytest.raises(InvalidStateDictError, match="fan_in_fan_out=True"):
        LoraMerge("stack", scaling=SCALING)(base, sites, [1.0])
    got = LoraMerge("stack", scaling=SCALING, fan_in_fan_out=True)(base, sites, [1.0])
    m = "q"
    a, b = (sites[0][f"{P}.{m}.{x}.default.weight"].double() for x in ("lora_A", "lora_B"))
    want = base[f"{P}.{m}.base_layer.weight"].double() + SCALING * (b @ a).T
    assert torch.allclose(got[f"{P}.{m}.base_layer.weight"].double(), want, atol=1e-6)


def test_round_through_the_aggregator_publishes_the_merge(tmp_path) -> None:
    base = peft_state()
    global_url = f"file://{tmp_path}/global"
    urls = {"a": f"file://{tmp_path}/sites/a", "b": f"file://{tmp_path}/sites/b"}
    merge = LoraMerge("stack", scaling=SCALING)
    counts = {"a": 30, "b": 10}
    results: dict[str, dict[str, torch.Tensor]] = {}
    with Aggregator(global_url, urls, dtype=torch.float32, merge=merge) as agg:
        agg.start(base)
        for i, (name, url) in enumerate(sorted(urls.items())):
            with Site(global_url, url, dtype=torch.float32) as site:
                def train(weights: dict[str, torch.Tensor], i: int = i) -> dict[str, torch.Tensor]:
                    return {**weights, **site_change(weights, i, ("q",) if i else ("q", "v"))}
                rnd = site.run_round(train, num_examples=counts[name])
                assert rnd.base == 1
            results[name] = train(dict(base))
        report = agg.run_round(quorum=2)
        assert sorted(report.accepted) == ["a", "b"]
    with Subscriber(global_url) as sub:
        published = sub.pull(report.published.version)
    changed = [{n: t for n, t in results[s].items() if not torch.equal(bit_pattern(t), bit_pattern(base[n]))}
               for s in sorted(results)]
    want = {**base, **merge(base, changed, [0.75, 0.25])}
    assert_bits_equal(published, want)
    assert not published[f"{P}.q.lora_B.default.weight"].any()
    assert not torch.equal(published[f"{P}.q.base_layer.weight"], base[f"{P}.q.base_layer.weight"])
    with Subscriber(global_url) as sub:  # the global version names the merge that made it
        assert sub.latest().metadata["federated"]["merge"] == repr(merge)


def test_adapter_state_uses_peft_saved_names() -> None:
    state = peft_state()
    state[f"{P}.q.lora_A.other.weight"] = torch.zeros(RANK, 8)
    got = adapter_state(state)
    assert sorted(got) == sorted(f"{P}.{m}.{x}.weight" for m in SHAPES for x in ("lora_A", "lora_B"))
    assert got[f"{P}.q.lora_A.weight"] is state[f"{P}.q.lora_A.default.weight"]
    assert list(adapter_state(state, "other")) == [f"{P}.q.lora_A.weight"]
    with pytest.raises(InvalidStateDictError, match="'missing'"):
        adapter_state(state, "missing")


def test_saved_names_with_plain_base_weights_are_modules() -> None:
    state = {"m.q.weight": torch.zeros(12, 8), "m.q.lora_A.weight": torch.zeros(RANK, 8),
             "m.q.lora_B.weight": torch.zeros(12, RANK)}
    (m,) = lora_modules(state)
    assert (m.module, m.adapter, m.weight, m.rank) == ("m.q", None, "m.q.weight", RANK)


@pytest.mark.parametrize("broken, match", [
    (lambda s: s.pop(f"{P}.q.lora_B.default.weight"), "has no lora_B"),
    (lambda s: s.pop(f"{P}.v.lora_A.default.weight"), "has no lora_A"),
    (lambda s: s.pop(f"{P}.q.base_layer.weight"), "has no base weight"),
    (lambda s: s.update({f"{P}.v.lora_B.default.weight": torch.zeros(6, RANK + 1)}), "does not give base weight"),
    (lambda s: s.update({f"{P}.v.base_layer.weight": torch.zeros(7, 8)}), "does not give base weight"),
])
def test_broken_lora_layouts_are_refused_by_name(broken, match) -> None:
    state = peft_state()
    broken(state)
    for mode in ("fedavg", "stack"):
        with pytest.raises(InvalidStateDictError, match=match):
            LoraMerge(mode, scaling=SCALING)(state, [], [])  # type: ignore[arg-type]


def test_stack_refuses_what_it_cannot_fold() -> None:
    base = peft_state()
    base[f"{P}.q.lora_magnitude_vector.default.weight"] = torch.ones(12)
    dora = {f"{P}.q.lora_magnitude_vector.default.weight": torch.full((12,), 2.0)}
    with pytest.raises(InvalidStateDictError, match="lora_magnitude_vector"):
        LoraMerge("stack", scaling=SCALING)(base, [dora], [1.0])
    assert set(LoraMerge()(base, [dora], [1.0])) == set(dora)  # fedavg averages it per tensor
    with pytest.raises(InvalidStateDictError, match="is torch.float64"):
        LoraMerge()(peft_state(), [{f"{P}.k.weight": torch.zeros(12, 8, dtype=torch.float64)}], [1.0])


def test_configs() -> None:
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "fan_in_fan_out": False}
    assert LoraMerge.from_peft_config(cfg, "stack").scaling == 2.0
    assert LoraMerge.from_peft_config({**cfg, "use_rslora": True}, "stack").scaling == pytest.approx(16 / math.sqrt(8))
    assert LoraMerge.from_peft_config({**cfg, "fan_in_fan_out": True}, "stack").fan_in_fan_out
    assert LoraMerge.from_peft_config({**cfg, "rank_pattern": {"q": 4}}).mode == "fedavg"
    for extra, match in [({"rank_pattern": {"q": 4}}, "rank_pattern"), ({"alpha_pattern": {"q": 4}}, "alpha_pattern"),
                         ({"use_dora": True}, "DoRA"), ({"peft_type": "IA3"}, "LoRA config")]:
        with pytest.raises(ValueError, match=match):
            LoraMerge.from_peft_config({**cfg, **extra}, "stack")
    with pytest.raises(ValueError, match="scaling"):
        LoraMerge("stack")
    with pytest.raises(ValueError, match="mode"):
        LoraMerge("mean")  # type: ignore[arg-type]


def test_aggregate_command_merges_lora_rounds(tmp_path, capsys) -> None:
    """`deltastore aggregate --merge lora-stack --lora-config adapter_config.json`: the round is
    LoraMerge's, with the config's scaling; lora-stack without a config is a usage error."""
    import json

    from safetensors.torch import save_file

    from deltastore.cli import EXIT_USAGE, main

    g, a = f"{tmp_path}/global", f"{tmp_path}/sites/a"
    base = peft_state()
    save_file(base, str(tmp_path / "init.safetensors"))
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": SCALING * RANK}))
    cmd = ["aggregate", g, "--site", f"a={a}", "--dtype", "keep", "--interval", "0.05", "--json"]
    assert main([*cmd, "--merge", "lora-stack"]) == EXIT_USAGE
    assert "--lora-config" in capsys.readouterr().err
    assert main([*cmd, "--lora-config", str(config)]) == EXIT_USAGE  # a config without a LoRA merge
    capsys.readouterr()
    assert main([*cmd, "--init", str(tmp_path / "init.safetensors"), "--deadline", "0.1s"]) == 1  # publishes version 1
    capsys.readouterr()
    with Site(g, a, dtype=torch.float32) as site:
        site.run_round(lambda w: {**w, **site_change(w, 0)})
    assert main([*cmd, "--merge", "lora-stack", "--lora-config", str(config), "--deadline", "5s"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["accepted"] == ["a"]
    changed = site_change(base, 0)
    with Subscriber(g) as sub:
        assert sub.latest().metadata["federated"]["merge"] == repr(LoraMerge("stack", scaling=SCALING))
        assert_bits_equal(sub.pull(2), {**base, **LoraMerge("stack", scaling=SCALING)(base, [changed], [1.0])})
