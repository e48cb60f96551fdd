"""``deltastore aggregate`` (design 009): rounds from the command line, one JSON line each; a
refused command line or an empty global store without ``--init`` leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deltastore import Subscriber
from deltastore.cli import EXIT_FAILED, EXIT_USAGE, main
from deltastore.federated import Site
from testkit.federated import initial_state, reference_merge, served, trained
from testkit.tensors import assert_bits_equal


def test_aggregate_cli_refuses_an_unsigned_result_of_a_site_with_a_key(tmp_path, capsys) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    g, sites = str(tmp_path / "global"), {f"s{i}": str(tmp_path / "sites" / f"s{i}") for i in range(2)}
    init = tmp_path / "init.safetensors"
    save_file(initial_state(), str(init))
    key = Ed25519PrivateKey.generate()
    pub = tmp_path / "s0.pub.pem"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    site_args = [a for name, u in sites.items() for a in ("--site", f"{name}={u}")]
    # publishes version 1; no site answers by the deadline: exit 1
    assert main(["aggregate", g, *site_args, "--init", str(init), "--deadline", "0.2s", "--interval", "0.05"]) == 1
    capsys.readouterr()
    ss = [Site(g, u, dtype=torch.bfloat16) for u in sites.values()]  # unsigned, both
    try:
        for i, s in enumerate(ss):
            s.run_round(lambda w, i=i: trained(w, i, 0))
        assert main(["aggregate", g, *site_args, "--site-key", f"s0={pub}", "--quorum", "1", "--deadline", "1s",
                     "--interval", "0.05", "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["accepted"] == ["s1"], out
        (s0,) = [o for o in out["sites"] if o["site"] == "s0"]
        assert s0["status"] == "refused" and "Signature" in s0["error_type"], s0
    finally:
        for s in ss:
            s.close()


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


def test_aggregate_cli_publishes_serving_formats_of_each_global_version(tmp_path, capsys) -> None:
    from deltastore.serving.formats import derive, serving_format

    g, sites = str(tmp_path / "global"), {f"s{i}": str(tmp_path / "sites" / f"s{i}") for i in range(2)}
    state = {**initial_state(), "mlp.weight": (torch.randn(128, 128, generator=torch.Generator().manual_seed(5))
                                               * 0.02).to(torch.bfloat16)}
    init = tmp_path / "init.safetensors"
    save_file(state, str(init))
    site_args = [a for name, u in sites.items() for a in ("--site", f"{name}={u}")]
    formats = ["--format", "bf16", "--format", "fp8-block128"]
    # version 1; no site answers by the deadline: exit 1
    assert main(["aggregate", g, *site_args, "--init", str(init), "--deadline", "0.2s", "--interval", "0.05",
                 *formats]) == 1
    ss = [Site(g, u, dtype=torch.bfloat16) for u in sites.values()]
    try:
        for i, s in enumerate(ss):
            s.run_round(lambda w, i=i: {**trained(w, i, 0), "mlp.weight": w["mlp.weight"].float() * (1.01 + i / 100)})
        capsys.readouterr()
        assert main(["aggregate", g, *site_args, "--interval", "0.1", "--json", *formats]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["version"] == 2
        with Subscriber(g) as sub, Subscriber(g, format="fp8-block128") as fp8:
            assert [i.formats for i in sub.log()] == [("bf16", "fp8-block128")] * 2
            for v in (1, 2):
                assert_bits_equal(fp8.pull(v), derive(sub.pull(v), serving_format("fp8-block128")))
    finally:
        for s in ss:
            s.close()


@pytest.mark.parametrize("flags, code, words", [
    ([], EXIT_FAILED, "has no version yet"),
    (["--site", "bad"], EXIT_USAGE, "NAME=URL"),
    (["--site", "s0=s3:/typo"], EXIT_USAGE, "s3://typo"),
    (["--site", "s0={root}/again"], EXIT_USAGE, "must be unique"),
    (["--rounds", "-1"], EXIT_USAGE, "--rounds"),
    (["--quorum", "3"], EXIT_USAGE, "--quorum 3"),
    (["--quorum", "0"], EXIT_USAGE, "--quorum"),
    (["--interval", "0"], EXIT_USAGE, "--interval"),
    (["--dtype", "int8"], EXIT_USAGE, "--dtype"),
    (["--init", "{root}/missing.safetensors"], EXIT_FAILED, "missing.safetensors"),
    (["--site-key", "s9={root}/k.pem"], EXIT_USAGE, "no --site gives"),
    (["--site-key", "s0"], EXIT_USAGE, "NAME=PUBLIC.pem"),
    (["--late", "keep"], EXIT_USAGE, "--late"),
    (["--late-weight", "0"], EXIT_USAGE, "--late-weight"),
    (["--format", "fp7"], EXIT_USAGE, "'fp7' is not a serving format"),
], ids=["no-init", "site-without-name", "site-url", "site-twice", "rounds", "quorum-above-sites", "quorum-0",
        "interval", "dtype", "init-missing", "site-key-site", "site-key-form", "late", "late-weight", "format"])
@pytest.mark.parametrize("global_exists", [False, True], ids=["no-dir", "empty-dir"])
def test_a_refused_aggregate_leaves_nothing_behind(flags, code, words, global_exists, tmp_path, capsys) -> None:
    g, sites = tmp_path / "global", [tmp_path / "sites" / f"s{i}" for i in range(2)]
    if global_exists:
        g.mkdir()
    site_args = [a for i, u in enumerate(sites) for a in ("--site", f"s{i}={u}")]
    argv = ["aggregate", str(g), *site_args, *(f.format(root=tmp_path) for f in flags)]
    assert main(argv) == code
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("deltastore: error: ") and words in err[0], err
    assert len(err) <= 2 and all(line.startswith("hint: ") for line in err[1:]), err
    if flags == []:
        assert err[1] == "hint: pass --init FILE.safetensors: it is published as global version 1"
    # Nothing taken over, locked or created: no global HEAD, no site directories.
    assert sorted(p.name for p in tmp_path.iterdir()) == (["global"] if global_exists else [])
    assert not global_exists or list(g.iterdir()) == []
