"""Tied weights (deltastore.layout.tied): the three writers publish a tied model in one layout, and a
module target follows it whatever the writer left out, with the tie intact."""

from __future__ import annotations

import pytest
import torch

from deltastore import CachePolicy, PollPolicy, Publisher, Subscriber
from deltastore.errors import LayoutMismatchError
from deltastore.layout.tied import ModuleTensors, recorded_aliases, tied_aliases

transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra's bench/trl installs)")

ALIAS, SOURCE = "lm_head.weight", "model.embed_tokens.weight"
WRITERS = ("publisher", "callback", "trl")


def _llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _step(model: torch.nn.Module, seed: int) -> None:
    """A training step's worth of change to every parameter (the tied embedding included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def _served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}


def _publish_two(writer: str, url: str) -> dict[int, dict[str, torch.Tensor]]:
    """Versions 1 and 2 of a trained tiny tied Llama, published by ``writer`` in bf16; the
    trainer's weights at each, as served."""
    model, want = _llama(0), {}
    if writer == "publisher":
        with Publisher(url, dtype=torch.bfloat16) as pub:
            for v in (1, 2):
                pub.publish(model, step=v)
                want[v] = _served(model)
                _step(model, v)
    elif writer == "callback":
        from transformers import TrainerControl, TrainerState

        from deltastore.integrations.transformers import DeltastoreCallback

        cb, state, control = DeltastoreCallback(url), TrainerState(), TrainerControl()
        state.is_world_process_zero = True
        cb.on_train_begin(None, state, control)
        for v in (1, 2):
            state.global_step = v
            cb.on_step_end(None, state, control, model=model)
            cb.futures[-1].result(timeout=60)
            want[v] = _served(model)
            _step(model, v)
        cb.on_train_end(None, state, control, model=None)
    else:  # TRL's AsyncGRPOTrainer streams named_parameters() and does not tell the backend the ties
        from deltastore.integrations.trl import DeltastoreWeightTransfer

        wt = DeltastoreWeightTransfer(url)
        wt.init_weight_transfer()
        for v in (1, 2):
            wt.send_weights(iter(list(model.named_parameters())))
            wt.flush()
            want[v] = _served(model)
            _step(model, v)
        wt.destroy()
    return want


def _fresh() -> torch.nn.Module:
    return _llama(7).to(torch.bfloat16)


def _assert_holds(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    """``model`` holds ``want`` bit for bit and its head is still tied to its embedding."""
    got = model.state_dict()
    assert set(got) == set(want)
    for n, t in want.items():
        assert torch.equal(got[n].view(torch.int16), t.view(torch.int16)), n
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.fixture(params=WRITERS)
def published(request, tmp_path) -> tuple[str, str, dict[int, dict[str, torch.Tensor]]]:
    url = str(tmp_path / f"store-{request.param}")
    return request.param, url, _publish_two(request.param, url)


def test_writers_publish_the_alias_once_and_record_it(published) -> None:
    writer, url, want = published
    with Subscriber(url, threads=1) as sub:
        assert set(sub.pull(1)) == set(want[1]) - {ALIAS}
        meta = sub.info(1).metadata
    # Publisher(model) and the callback know the module; TRL's stream of named_parameters() does not
    assert recorded_aliases(meta) == ({} if writer == "trl" else {ALIAS: SOURCE})


def test_pull_into_and_stage_swap_into_a_module(published) -> None:
    _, url, want = published
    model = _fresh()
    with Subscriber(url, threads=1) as sub:
        assert sub.pull_into(model, version=1).version == 1
        _assert_holds(model, want[1])
        assert set(sub.last_changed) == set(want[1]) - {ALIAS}
        staged = sub.stage(model)
        assert staged is not None and staged.info.version == 2
        sub.swap(staged, model)
        _assert_holds(model, want[2])
        assert sub.pull_into(model) is None  # current: nothing to do


@pytest.mark.parametrize("swap_mode", ["inplace", "rebind"])
def test_follow_into_a_module(published, swap_mode) -> None:
    _, url, want = published
    fresh, held = _fresh(), _fresh()
    with Subscriber(url, threads=1) as sub:  # nothing held: the latest version loaded whole
        [rec] = sub.follow(fresh, poll=PollPolicy(0.01), max_versions=1, heartbeat=None, swap_mode=swap_mode)
        assert rec.info.version == 2 and rec.full_load
        _assert_holds(fresh, want[2])
    with Subscriber(url, threads=1) as sub:  # from a held version: staged, then swapped
        sub.pull_into(held, version=1)
        [rec] = sub.follow(held, poll=PollPolicy(0.01), max_versions=1, heartbeat=None, swap_mode=swap_mode)
        assert (rec.from_version, rec.info.version) == (1, 2) and not rec.full_load
        _assert_holds(held, want[2])


def test_follow_with_a_worker_cache_keeps_the_alias_out_of_it(tmp_path) -> None:
    url, cache = str(tmp_path / "store"), tmp_path / "cache"
    want = _publish_two("callback", url)
    with Subscriber(url, threads=1) as sub:
        list(sub.follow(_fresh(), poll=PollPolicy(0.01), max_versions=1, heartbeat=None, cache=CachePolicy(cache)))
    model = _fresh()
    with Subscriber(url, threads=1) as sub:  # adopted from the cache: verified, nothing fetched
        [rec] = sub.follow(model, poll=PollPolicy(0.01), max_versions=1, heartbeat=None, cache=CachePolicy(cache))
        assert rec.info.version == 2 and rec.bytes_fetched == 0
    _assert_holds(model, want[2])


def test_a_dict_target_is_strict_and_names_the_tied_alias(tmp_path) -> None:
    url = str(tmp_path / "store")
    _publish_two("callback", url)
    model = _fresh()
    with Subscriber(url, threads=1) as sub:
        # model.state_dict(): the alias shares memory with its source
        with pytest.raises(LayoutMismatchError, match=r"'lm_head.weight' is a tied alias of 'model.embed_tokens.weight'.*nn.Module"):
            sub.pull_into(model.state_dict())
        # a dict of its own tensors: the version's record says why
        own = {n: t.clone() for n, t in model.state_dict().items()}
        with pytest.raises(LayoutMismatchError, match=r"'lm_head.weight' is a tied alias of 'model.embed_tokens.weight'"):
            sub.pull_into(own)
        # a module whose head is not tied to the embedding cannot follow the tied version
        untied = _fresh()
        untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
        with pytest.raises(LayoutMismatchError, match=r"records 'lm_head.weight' as a tied alias .* does not share memory"):
            sub.pull_into(untied)
        # a dict without the alias is the version's layout
        weights = {n: t for n, t in model.state_dict().items() if n != ALIAS}
        assert sub.pull_into(weights).version == 2


def test_a_module_follows_a_version_that_publishes_the_alias_too(tmp_path) -> None:
    """A dict of both names (model.state_dict()) stays a layout of its own: a module target
    then updates the shared memory once, through its first name."""
    url, model = str(tmp_path / "store"), _llama(0)
    with Publisher(url, dtype=torch.bfloat16) as pub:
        pub.publish(dict(model.state_dict()))
    target = _fresh()
    with Subscriber(url, threads=1) as sub:
        assert sub.pull_into(target).version == 1
        assert set(sub.units()) == set(model.state_dict())
    _assert_holds(target, _served(model))


def test_module_tensors_put_an_alias_back_when_a_version_publishes_it() -> None:
    model = _fresh()
    tensors = ModuleTensors(dict(model.state_dict(keep_vars=True)))
    names = set(tensors) - {ALIAS}
    assert tensors.fit(names) and ALIAS not in tensors and tensors.aside == {ALIAS: SOURCE}
    tensors.update(model.state_dict())  # a refresh after a swap by rebinding keeps it aside
    assert ALIAS not in tensors
    assert not tensors.fit(names)
    assert tensors.fit(names | {ALIAS}) and tensors[ALIAS] is tensors[SOURCE] and not tensors.aside


def test_tied_aliases_name_the_kept_parameter() -> None:
    class Three(torch.nn.Module):
        """One memory under three names; named_parameters() keeps the second registered."""

        def __init__(self):
            super().__init__()
            w = torch.nn.Parameter(torch.ones(4, 2))
            self.register_buffer("a", w.data)  # a buffer first, then two names of the parameter
            self.b = torch.nn.Linear(2, 4, bias=False)
            self.b.weight = w
            self.c = torch.nn.Linear(2, 4, bias=False)
            self.c.weight = w

    m = Three()
    assert [n for n, _ in m.named_parameters()] == ["b.weight"]
    assert tied_aliases(m) == {"a": "b.weight", "c.weight": "b.weight"}
    assert tied_aliases(_llama(0)) == {ALIAS: SOURCE}
