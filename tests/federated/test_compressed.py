"""The opt-in compressed tier (design 009 D11, SPEC §14.1): what a site sends (top-k of its
change, quantized, with error feedback), how its versions say so, and who reads them."""

from __future__ import annotations

import uuid

import pytest
import torch

from deltastore.federated import Aggregator, Compression, Compressor, ResultPolicy, Site
from deltastore.federated.compress import quantize
from deltastore.format.history import History
from deltastore.format.models import dump
from deltastore.storage import open_store
from deltastore.write.policy import LayoutPolicy, WriterPolicy
from testkit.federated import initial_state, reference_merge, served, trained
from testkit.tensors import assert_bits_equal


def _urls(n: int = 2) -> tuple[str, dict[str, str]]:
    root = f"memory://compressed-{uuid.uuid4().hex[:10]}"
    return f"{root}/global", {f"site-{i}": f"{root}/sites/site-{i}" for i in range(n)}


def _aggregator(global_url: str, sites: dict[str, str], **kw) -> Aggregator:
    return Aggregator(global_url, sites, dtype=torch.bfloat16, poll_interval_s=0.05,
                      writer_policy=WriterPolicy(threads=1), layout_policy=LayoutPolicy(chunk_bytes=4096), **kw)


def _site(global_url: str, site_url: str, **kw) -> Site:
    return Site(global_url, site_url, dtype=torch.bfloat16, writer_policy=WriterPolicy(threads=1), **kw)


# --- what a site sends -----------------------------------------------------------------------


def test_compress_sends_the_top_k_quantized_and_keeps_the_rest() -> None:
    g = torch.Generator().manual_seed(3)
    base = {"w": (torch.randn(64, 64, generator=g) * 0.1).to(torch.bfloat16), "n": torch.arange(4)}
    state = {"w": base["w"].float() + torch.randn(64, 64, generator=g) * 0.05, "n": torch.arange(4) + 1}
    c = Compressor(Compression(density=0.05, bits=2))
    sent = c.compress(state, base)
    assert sent["w"].dtype == torch.bfloat16 and torch.equal(sent["n"], state["n"])  # integers: as they are
    moved = sent["w"].view(torch.int16) != base["w"].view(torch.int16)
    k = int(0.05 * 64 * 64) + 1
    assert 0 < int(moved.sum()) <= k
    # the elements sent are among those whose change is largest
    change = (state["w"] - base["w"].float()).abs()
    assert change[moved].min() >= change.flatten().topk(k).values.min()
    # error feedback: what was sent plus what is kept is the whole change (fp32 arithmetic)
    applied = sent["w"].float() - base["w"].float()
    torch.testing.assert_close(applied + c.residual["w"], state["w"] - base["w"].float(), rtol=0, atol=1e-6)


def test_changes_the_served_dtype_cannot_hold_wait_in_the_residual() -> None:
    """bf16 base: the largest changes are below half a bf16 spacing of their (large) elements
    and would round away; the budget goes to smaller changes of small elements, which bf16
    holds, and the others stay in the residual until they have grown enough."""
    base = {"w": torch.cat([torch.full((50,), 64.0), torch.full((50,), 0.01)]).to(torch.bfloat16)}
    change = torch.cat([torch.full((50,), 0.1), torch.full((50,), 0.001)])  # 64's spacing is 0.5
    c = Compressor(Compression(density=0.1, bits=1))
    sent = c.compress({"w": base["w"].float() + change}, base)
    moved = sent["w"].view(torch.int16) != base["w"].view(torch.int16)
    assert int(moved[:50].sum()) == 0 and int(moved[50:].sum()) == 10
    torch.testing.assert_close(c.residual["w"][:50], change[:50])
    for _ in range(2):  # 0.1 more each round: past 0.25 (half of 0.5) on the third
        sent = c.compress({"w": sent["w"].float() + torch.cat([change[:50], torch.zeros(50)])}, sent)
    assert int((sent["w"][:50].float() != 64.0).sum()) == 10


def test_quantize_uses_two_to_the_bits_minus_one_magnitudes_per_sign() -> None:
    v = torch.arange(-50, 51, dtype=torch.float32) / 50
    for bits in (1, 2, 3):
        q = quantize(v, bits)
        assert torch.equal(torch.sign(q), torch.sign(v))
        assert len(torch.unique(q[v > 0].abs())) <= 2 ** (bits - 1)
    # the magnitudes are group means: one level keeps the mean magnitude
    assert torch.allclose(quantize(v, 1).abs()[v != 0], v.abs().mean() * torch.ones(100))


def test_error_feedback_sends_every_part_of_a_change_over_rounds() -> None:
    """A constant change, 1 % of it sent per round: with error feedback the base converges to
    base + rounds × change in every element; without it, most elements never move."""
    step = torch.linspace(0.001, 0.002, 1000)
    for feedback in (True, False):
        c = Compressor(Compression(density=0.01, bits=8, error_feedback=feedback))
        cur = {"w": torch.zeros(1000, dtype=torch.float32)}
        for _ in range(300):
            cur = c.compress({"w": cur["w"] + step}, cur)
        moved = int((cur["w"] != 0).sum())
        if feedback:
            assert moved == 1000
            # what moved plus what is kept is everything the rounds asked for
            torch.testing.assert_close(cur["w"] + c.residual["w"], 300 * step, rtol=1e-4, atol=1e-5)
        else:
            assert moved < 100 and not c.residual


def test_compression_settings_are_checked() -> None:
    for bad in (0, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="density"):
            Compression(density=bad)
    for bad in (0, 9, 2.0):
        with pytest.raises(ValueError, match="bits"):
            Compression(bits=bad)
    with pytest.raises(TypeError):
        Compressor({"density": 0.1})  # type: ignore[arg-type]


# --- who reads a compressed version ------------------------------------------------------------


def test_compressed_result_refused_unless_the_aggregator_opts_in() -> None:
    global_url, site_urls = _urls()
    comp = Compression(density=0.05, bits=2)
    with _aggregator(global_url, site_urls) as agg:
        agg.start(initial_state())
        lossless, compressed = _site(global_url, site_urls["site-0"]), _site(global_url, site_urls["site-1"], compression=comp)
        try:
            lossless.run_round(lambda w: trained(w, 0, 0))
            compressed.run_round(lambda w: trained(w, 1, 0))
            report = agg.run_round(quorum=1, deadline_s=0.5)
            refused = {o.site: o for o in report.sites}["site-1"]
            assert refused.status == "refused" and refused.error_type == "CompressedVersionError"
            assert "site-1" in refused.error and "accept_compressed" in refused.error
            assert report.accepted == ["site-0"]
        finally:
            lossless.close()
            compressed.close()


def test_compressed_round_is_exact_to_what_the_site_published() -> None:
    """The site's version says it is compressed; an opted-in aggregator merges exactly the
    state the site published (recomputed here by an independent Compressor on the same
    inputs), and the global version names the compressed sites."""
    global_url, site_urls = _urls()
    comp = Compression(density=0.02, bits=2)
    with _aggregator(global_url, site_urls, results=ResultPolicy(accept_compressed=True)) as agg:
        agg.start(initial_state())
        sites = [_site(global_url, u, compression=comp) for u in site_urls.values()]
        mirror = [Compressor(comp) for _ in sites]
        try:
            for rnd in range(2):
                base = {n: t.clone() for n, t in agg.state().items()}
                expected = []
                for i, s in enumerate(sites):
                    r = s.run_round(lambda w, i=i, rnd=rnd: trained(w, i, rnd))
                    expected.append(mirror[i].compress(trained(base, i, rnd), base))
                    h = History(open_store(site_urls[f"site-{i}"]))
                    m = h.head_manifest(h.read_head()[0])[1]
                    assert m.compression is not None and m.compression.density == 0.02 and m.compression.bits == 2
                    assert r.published.version == rnd + 1
                report = agg.run_round()
                assert all(o.compressed for o in report.sites)
                assert_bits_equal(agg.state(), reference_merge(base, expected, [0.5, 0.5]))
                assert any(not torch.equal(agg.state()[n], base[n]) for n in base)
            head, _ = History(agg.publisher.store).read_head()
            fed = History(agg.publisher.store).head_manifest(head)[1].metadata["federated"]
            assert fed["compressed"]["site-0"] == {"method": "topk", "density": 0.02, "bits": 2, "error_feedback": True}
        finally:
            for s in sites:
                s.close()


def test_compression_is_a_field_of_based_versions_only(capsys) -> None:
    from pydantic import ValidationError

    from deltastore.cli import main

    global_url, site_urls = _urls(1)
    with _aggregator(global_url, site_urls, results=ResultPolicy(accept_compressed=True)) as agg:
        agg.start(initial_state())
        with _site(global_url, site_urls["site-0"], compression=Compression()) as s:
            s.run_round(lambda w: served(trained(w, 0, 0)))
        h = History(open_store(site_urls["site-0"]))
        key, m = h.head_manifest(h.read_head()[0])
        doc = m.model_dump(mode="json", by_alias=True)
        assert doc["compression"] == {"method": "topk", "density": 0.01, "bits": 2, "error_feedback": True}
        doc.pop("base")
        with pytest.raises(ValidationError, match="compression is a field of based versions only"):
            type(m).model_validate(doc)
        # a plain version's canonical document (what signatures cover) has no compression key at
        # all: older readers forbid unknown keys, and older signatures stay valid
        g = History(agg.publisher.store)
        plain = g.head_manifest(g.read_head()[0])[1]
        assert b'"compression"' not in dump(plain) and b'"compression"' in dump(m)


def test_error_feedback_survives_a_site_restart_and_a_failed_publish(tmp_path) -> None:
    """The residual is saved after each published result and read back by a restarted site; a
    publish that fails leaves it as it was before the attempt (nothing was sent)."""
    from deltastore.errors import StorageError

    global_url, site_urls = _urls(1)
    path = tmp_path / "residual.safetensors"
    comp = Compression(density=0.02)
    with _aggregator(global_url, site_urls, results=ResultPolicy(accept_compressed=True)) as agg:
        agg.start(initial_state())
        with _site(global_url, site_urls["site-0"], compression=comp, residual_path=path) as s:
            s.run_round(lambda w: trained(w, 0, 0))
            saved = s.compressor.state_dict()
        assert path.exists() and any(bool(t.abs().sum()) for t in saved.values())
        store = open_store(site_urls["site-0"])
        with _site(global_url, site_urls["site-0"], compression=comp, residual_path=path, site_store=store) as s:
            assert_bits_equal(s.compressor.residual, saved)
            s.pull()

            def broken(*a, **k):
                raise StorageError("the site's bucket is unreachable")

            store.put = broken  # every upload of this attempt fails
            with pytest.raises(StorageError):
                s.publish_result(trained(s.weights, 0, 1))
            assert_bits_equal(s.compressor.residual, saved)
    with pytest.raises(ValueError, match="compression"):
        _site(global_url, site_urls["site-0"], residual_path=path)
