"""``deltastore site join|publish|run`` (design 009): a site with no Python glue beyond its
training program, end to end against an in-process aggregator."""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file, save_file

from deltastore.cli import EXIT_FAILED, EXIT_USAGE, main
from deltastore.federated import Aggregator
from deltastore.format.history import History
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.federated import initial_state, reference_merge, served
from testkit.tensors import assert_bits_equal

#: The training program of site b: fp32 masters from the base, two rows moved, its weight
#: in a metadata file. ``train`` below is the same arithmetic, for the expected merge.
TRAIN = """
import json, os, torch
from safetensors.torch import load_file, save_file
w = {n: t.float() if t.is_floating_point() else t for n, t in load_file(os.environ["DELTASTORE_BASE_FILE"]).items()}
w["w"][10:12] += 0.004
w["emb"][7] -= 0.002
save_file(w, os.environ["DELTASTORE_OUTPUT_FILE"])
with open(os.environ["DELTASTORE_METADATA_FILE"], "w") as f:
    json.dump({"num_examples": 3, "site_seen": os.environ["DELTASTORE_SITE"]}, f)
"""


def train(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: t.float() if t.is_floating_point() else t.clone() for n, t in w.items()}
    out["w"][10:12] += 0.004
    out["emb"][7] -= 0.002
    return out


def test_site_join_publish_and_run_end_to_end(tmp_path, capsys) -> None:
    g, sa, sb = (str(tmp_path / p) for p in ("global", "sites/a", "sites/b"))
    with Aggregator(g, {"a": sa, "b": sb}, dtype=torch.bfloat16, poll_interval_s=0.05,
                    writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=4096)) as agg:
        agg.start(initial_state())
        base = {n: t.clone() for n, t in agg.state().items()}

        # site a: join, train by hand, publish the file
        joined = str(tmp_path / "a-base.safetensors")
        assert main(["site", "join", g, sa, "--name", "a", "--out", joined, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["base"] == 1
        assert_bits_equal(load_file(joined), base)
        mine = load_file(joined)
        mine["b"][:4] = 0.25
        trained_a = str(tmp_path / "a-trained.safetensors")
        save_file(mine, trained_a)
        wrong = str(tmp_path / "a-wrong.safetensors")
        save_file({"w": mine["w"]}, wrong)
        assert main(["site", "publish", g, sa, wrong, "--name", "a", "--base-file", joined]) == EXIT_FAILED
        assert "missing" in capsys.readouterr().err
        assert main(["site", "publish", g, sa, trained_a, "--name", "a", "--base-file", joined,
                     "--num-examples", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) | {"bytes_up": 0} == {"site": "a", "base": 1, "version": 1, "bytes_up": 0}

        # site b: one round of `site run` with a training command (fp32 output, cast back to bf16)
        assert main(["site", "run", g, sb, "--name", "b"]) == EXIT_USAGE
        capsys.readouterr()
        assert main(["site", "run", g, sb, "--name", "b", "--rounds", "1", "--deadline", "60s", "--interval", "0.05",
                     "--workdir", str(tmp_path / "work"), "--json", "--", sys.executable, "-c", TRAIN]) == 0
        line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (line["site"], line["base"], line["version"]) == ("b", 1, 1)
        st = open_store(sb)
        meta = History(st).head_manifest(History(st).read_head()[0])[1].metadata
        assert meta == {"num_examples": 3, "site": "b", "site_seen": "b"}

        # a restarted site that already answered the round does not train it again: it waits for
        # the next global version, and no longer than --deadline (the command never runs)
        assert main(["site", "run", g, sb, "--name", "b", "--rounds", "1", "--deadline", "0.2s", "--interval", "0.05",
                     "--", sys.executable, "-c", "raise SystemExit(3)"]) == EXIT_FAILED
        assert "no global version after 1" in capsys.readouterr().err

        report = agg.run_round()
        assert report.accepted == ["a", "b"]
        assert [o.weight for o in report.sites] == [0.25, 0.75]
        expected = reference_merge(base, [served(mine), served(train(base))], [0.25, 0.75])
        assert_bits_equal(agg.state(), expected)


def test_site_publish_compressed_and_aggregate_accepting_it(tmp_path, capsys) -> None:
    """`site publish --compressed` writes a compressed result (and its error to --residual);
    `aggregate` refuses it by default and merges exactly what was sent with --accept-compressed."""
    from deltastore.federated import Compression, Compressor

    g, sa = str(tmp_path / "global"), str(tmp_path / "sites/a")
    init = str(tmp_path / "init.safetensors")
    save_file(initial_state(), init)
    agg = ["aggregate", g, "--site", f"a={sa}", "--init", init, "--rounds", "1", "--interval", "0.05", "--json"]
    # version 1 (the round's base): an aggregate run whose round finds no result ends at its deadline
    assert main([*agg, "--deadline", "0.1s"]) == EXIT_FAILED
    capsys.readouterr()
    joined = str(tmp_path / "base.safetensors")
    assert main(["site", "join", g, sa, "--name", "a", "--out", joined]) == 0
    base = load_file(joined)
    trained = str(tmp_path / "trained.safetensors")
    save_file(train(base), trained)  # fp32 masters: the change is taken at full precision
    residual = tmp_path / "residual.safetensors"
    publish = ["site", "publish", g, sa, trained, "--name", "a", "--base-file", joined]
    assert main([*publish, "--residual", str(residual)]) == EXIT_USAGE
    assert "--compressed" in capsys.readouterr().err
    assert main([*publish, "--compressed", "2"]) == EXIT_USAGE
    capsys.readouterr()
    assert main([*publish, "--compressed", "0.05", "--residual", str(residual)]) == 0
    capsys.readouterr()
    mirror = Compressor(Compression(density=0.05, bits=2))
    sent = mirror.compress(train(base), base)
    assert_bits_equal(load_file(str(residual)), mirror.residual)

    assert main([*agg, "--deadline", "0.3s"]) == EXIT_FAILED  # refused: no result to merge
    err = capsys.readouterr().err
    assert "site a refused" in err and "is compressed (topk, density 0.05, 2 bits)" in err and "--accept-compressed" in err
    assert main([*agg, "--deadline", "5s", "--accept-compressed"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["accepted"] == ["a"] and report["sites"][0]["compressed"] is True
    with open_store(g) as st:
        from deltastore import Subscriber

        with Subscriber(g, store=st) as sub:
            assert_bits_equal(sub.pull(2), sent)
