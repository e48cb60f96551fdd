"""A federated site driven by a transformers ``Trainer`` ("usable from
transformers/TRL trainers"): the round's train callback loads the global weights into the
model, runs ``trainer.train()`` and returns ``model.state_dict()``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from deltastore import Subscriber
from deltastore.federated import Aggregator, Site
from deltastore.write.policy import WriterPolicy
from testkit.federated import reference_merge, served
from testkit.tensors import assert_bits_equal


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return transformers.BertForSequenceClassification(cfg)


class Data(torch.utils.data.Dataset):
    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (16, 12), generator=g)
        self.labels = torch.randint(0, 2, (16,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


@pytest.mark.slow
def test_sites_train_with_transformers_trainer(tmp_path) -> None:
    g = str(tmp_path / "global")
    sites = {f"s{i}": str(tmp_path / f"site{i}") for i in range(2)}
    init = served(tiny_model(0).state_dict())
    with Aggregator(g, sites, dtype=torch.bfloat16, poll_interval_s=0.05, writer_policy=WriterPolicy(threads=2)) as agg:
        agg.start(init)
        results = []
        for i, url in enumerate(sites.values()):
            model, data = tiny_model(0), Data(i)
            args = transformers.TrainingArguments(output_dir=str(tmp_path / f"out{i}"), max_steps=2,
                                                  per_device_train_batch_size=8, learning_rate=1e-3,
                                                  report_to="none", save_strategy="no", use_cpu=True,
                                                  disable_tqdm=True, logging_strategy="no", seed=i)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data)

            def train(weights: dict[str, torch.Tensor], model=model, trainer=trainer) -> dict[str, torch.Tensor]:
                model.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in weights.items()})
                trainer.train()
                return model.state_dict()

            with Site(g, url, dtype=torch.bfloat16) as site:
                r = site.run_round(train, num_examples=len(data))
                assert r.base == 1 and 0 < r.bytes_up
                results.append(served(model.state_dict()))
        base = {n: t.clone() for n, t in agg.state().items()}
        report = agg.run_round()
        assert report.accepted == ["s0", "s1"] and report.published.version == 2
        want = reference_merge(base, results, [0.5, 0.5])
        with Subscriber(g) as sub:
            assert_bits_equal(sub.pull(2), want)
