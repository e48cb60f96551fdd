"""``deltastore aggregate`` (design 009): rounds from the command line, one JSON line each."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from deltastore import Subscriber
from deltastore.cli import main
from deltastore.federated import Site
from tests._helpers import assert_bits_equal
from tests.test_federated import initial_state, reference_merge, served, trained


def test_aggregate_cli_json_rounds(tmp_path, capsys) -> None:
    g, sites = str(tmp_path / "global"), {f"s{i}": str(tmp_path / "sites" / f"s{i}") for i in range(2)}
    for u in (g, *sites.values()):
        (tmp_path / u).mkdir(parents=True, exist_ok=True)
    init = tmp_path / "init.safetensors"
    save_file(initial_state(), str(init))
    site_args = [a for name, u in sites.items() for a in ("--site", f"{name}={u}")]
    # round 1 needs version 1 first: --init publishes it, then the round waits with a deadline
    # that no site meets (quorum 1 of 2): exit 1, nothing merged
    assert main(["aggregate", g, *site_args, "--init", str(init), "--quorum", "1", "--deadline", "1s",
                 "--interval", "0.1", "--json"]) == 1
    capsys.readouterr()
    ss = [Site(g, u, dtype=torch.bfloat16) for u in sites.values()]
    try:
        results = []
        for i, s in enumerate(ss):
            s.run_round(lambda w, i=i: trained(w, i, 0), num_examples=1 + i)
            results.append(served(trained(s.weights, i, 0)))
        base = {n: t.clone() for n, t in ss[0].weights.items()}
        assert main(["aggregate", g, *site_args, "--interval", "0.1", "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["base"] == 1 and out["version"] == 2 and out["accepted"] == ["s0", "s1"]
        assert [s["weight"] for s in out["sites"]] == [1 / 3, 2 / 3]
        with Subscriber(g) as sub:
            assert_bits_equal(sub.pull(2), reference_merge(base, results, [1 / 3, 2 / 3]))
    finally:
        for s in ss:
            s.close()
