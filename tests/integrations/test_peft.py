"""deltastore.integrations.peft with a real (tiny) PEFT LoRA model on CPU: publish, materialize,
load back with PeftModel.from_pretrained bit for bit, and refuse adapters that do not fit."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

# Checked, not imported: importing peft costs seconds in every process that collects the suite;
# the tests that use it import it.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (pip install 'deltastore-weights[peft]')"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
]

from safetensors.torch import load_file

from deltastore import Subscriber
from deltastore.errors import AdapterMismatchError, FormatError
from deltastore.integrations.peft import (
    CONFIG_NAME,
    PEFT_KEY,
    WEIGHTS_NAME,
    AdapterPublisher,
    AdapterRecord,
    BaseLayout,
    BaseRef,
    adapter_config,
    adapter_state,
    check_adapter,
    check_base,
    materialize,
    read_marker,
)

BASE_NAME = "tiny-qwen2"


def _base(hidden: int = 16, *, device: str = "cpu") -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32, hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg)


def _lora(base: torch.nn.Module) -> Any:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             rank_pattern={"v_proj": 2})
    return peft.get_peft_model(base, config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three AdamW steps of a tiny LoRA, each published; the trained model's logits per version."""
    url = str(tmp_path_factory.mktemp("peft") / "adapter")
    pristine = _base()
    model = _lora(copy.deepcopy(pristine))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    probe = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(2))
    logits: dict[int, torch.Tensor] = {}
    with AdapterPublisher(url, base=BaseRef(BASE_NAME, store="memory://base", version=1)) as pub:
        for step in range(1, 4):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            info = pub.publish_async(model, step=step).result()
            model.eval()
            with torch.no_grad():
                logits[info.version] = model(input_ids=probe).logits.clone()
            model.train()
    return {"url": url, "pristine": pristine, "model": model, "probe": probe, "logits": logits}


def test_published_versions_load_back_bit_exact(trained: dict[str, Any], tmp_path: Path) -> None:
    from peft import PeftModel

    logits = trained["logits"]
    assert len({bytes(t.numpy()) for t in logits.values()}) == 3  # training moved the adapter each step
    with Subscriber(trained["url"]) as sub:
        for version, want in logits.items():
            adapter = materialize(sub, tmp_path / f"v{version}", version)
            assert adapter.version == version and adapter.step == version and adapter.path == tmp_path / f"v{version}"
            assert sorted(p.name for p in adapter.path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME, "deltastore.json"]
            assert read_marker(adapter.path)["manifest"] == adapter.manifest
            loaded = PeftModel.from_pretrained(copy.deepcopy(trained["pristine"]), str(adapter.path))
            loaded.eval()
            with torch.no_grad():
                got = loaded(input_ids=trained["probe"]).logits
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), version
            # materializing the same version again reuses the directory
            assert materialize(sub, adapter.path, version).path == adapter.path


def test_the_directory_is_what_peft_itself_saves(trained: dict[str, Any], tmp_path: Path) -> None:
    model = trained["model"]
    model.save_pretrained(str(tmp_path / "peft"))
    ours = materialize(trained["url"], tmp_path / "ours")  # the latest version: the model as it is now
    # PEFT writes a set (target_modules) in the process's set order, deltastore sorted
    theirs_config = json.loads((tmp_path / "peft" / CONFIG_NAME).read_text())
    theirs_config["target_modules"] = sorted(theirs_config["target_modules"])
    assert theirs_config == adapter_config(model) and theirs_config["base_model_name_or_path"] is None
    # the same file, with the base the publisher was told (a model built from a config has no name)
    assert json.loads((ours.path / CONFIG_NAME).read_text()) == {**theirs_config, "base_model_name_or_path": BASE_NAME}
    theirs, mine = load_file(str(tmp_path / "peft" / WEIGHTS_NAME)), load_file(str(ours.path / WEIGHTS_NAME))
    assert theirs.keys() == mine.keys() == adapter_state(model).keys()
    assert all(torch.equal(theirs[n], mine[n]) and theirs[n].dtype == mine[n].dtype for n in theirs)


def test_the_metadata_names_the_base(trained: dict[str, Any]) -> None:
    with Subscriber(trained["url"]) as sub:
        info = sub.latest()
    record = AdapterRecord.from_metadata(info.metadata)
    assert record.base == BaseRef(BASE_NAME, store="memory://base", version=1)
    assert record.config["base_model_name_or_path"] == BASE_NAME and record.config["peft_type"] == "LORA"
    assert record.adapter_name == "default" and set(info.metadata) == {PEFT_KEY}
    check_base(record, BASE_NAME)
    with pytest.raises(AdapterMismatchError, match="trained on base 'tiny-qwen2', not 'Qwen/Qwen3-0.6B'"):
        check_base(record, "Qwen/Qwen3-0.6B")
    check_base(record, BaseRef(BASE_NAME, store="memory://base"))  # the version unknown on one side
    with pytest.raises(AdapterMismatchError, match="trained on base version 1, not 2"):
        check_base(record, BaseRef(BASE_NAME, store="memory://base", version=2))
    with pytest.raises(FormatError, match="carries no PEFT adapter"):
        AdapterRecord.from_metadata({"model_version": 3})


def test_an_adapter_is_checked_against_the_base_it_is_applied_to(trained: dict[str, Any]) -> None:
    model = trained["model"]
    state, config = adapter_state(model), adapter_config(model)
    layout = BaseLayout.from_model(trained["pristine"])
    assert BaseLayout.from_model(model).shapes == layout.shapes  # a PeftModel's base, unwrapped
    check_adapter(state, config, layout)  # its own base, rank_pattern (v_proj: 2) honoured
    check_adapter(state, config, trained["pristine"])

    with pytest.raises(AdapterMismatchError, match=r"q_proj\.lora_A\.weight has 16 input features, the base's "
                                                   r"model\.layers\.0\.self_attn\.q_proj has 32"):
        check_adapter(state, config, _base(32, device="meta"))  # a wider base of the same family
    no_v = BaseLayout({n: s for n, s in layout.shapes.items() if "v_proj" not in n})
    with pytest.raises(AdapterMismatchError, match=r"v_proj\.lora_A\.weight adapts module "
                                                   r"model\.layers\.0\.self_attn\.v_proj, which the base model does not"):
        check_adapter(state, config, no_v)
    with pytest.raises(AdapterMismatchError, match="target module 'w_gate' of the adapter config is missing"):
        check_adapter(state, {**config, "target_modules": ["q_proj", "v_proj", "w_gate"]}, layout)
    with pytest.raises(AdapterMismatchError, match=r"q_proj\.lora_A\.weight has rank 4, the adapter config says r=8"):
        check_adapter(state, {**config, "r": 8}, layout)
    with pytest.raises(AdapterMismatchError, match=r"v_proj\.lora_A\.weight has rank 2, the adapter config says r=4"):
        check_adapter(state, {**config, "rank_pattern": {}})  # without a base: the config alone
    b = next(n for n in state if n.endswith("v_proj.lora_B.weight"))
    with pytest.raises(AdapterMismatchError, match=r"has rank 2 but .*v_proj\.lora_B\.weight has rank 1"):
        check_adapter({**state, b: state[b][:, :1]}, config)
    with pytest.raises(AdapterMismatchError, match=r"module model\.layers\.0\.self_attn\.v_proj has .* but no lora_B"):
        check_adapter({n: t for n, t in state.items() if n != b}, config)
    with pytest.raises(AdapterMismatchError, match="peft_type 'IA3' is not supported"):
        check_adapter(state, {**config, "peft_type": "IA3"})


def test_a_publisher_refuses_an_inconsistent_adapter_before_writing(tmp_path: Path) -> None:
    model = _lora(_base())
    config = adapter_config(model)
    with AdapterPublisher(str(tmp_path / "s")) as pub, pytest.raises(AdapterMismatchError):
        pub.publish_state(adapter_state(model), {**config, "r": 2})
    with Subscriber(str(tmp_path / "s")) as sub:
        assert sub.latest() is None  # no version was committed
