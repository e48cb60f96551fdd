"""Glue between deltastore and the frameworks around it (docs/integrations.md).

Each submodule imports its framework lazily and only when used; ``import deltastore`` never
imports any of them:

- :mod:`deltastore.integrations.trl` — ``DeltastoreWeightTransfer``, a TRL
  ``WeightTransferProtocol`` backend for ``AsyncGRPOTrainer`` (trainer side).
- :mod:`deltastore.integrations.transformers` — ``DeltastoreCallback``, publishing from a
  ``transformers.Trainer`` (trainer side).
- :mod:`deltastore.integrations.peft` — ``AdapterPublisher``, ``materialize``, ``check_adapter``:
  LoRA adapters (PEFT) as versions of a store, written back in PEFT's layout (trainer and
  worker side).
- :mod:`deltastore.integrations.vllm` — ``DeltastoreWorkerExtension``, a vLLM worker extension
  that follows a store and reloads only the changed tensors; ``VLLMServerSync`` drives it on
  ``vllm serve`` and tags the engine's ``weight_version`` (rollout side).
- :mod:`deltastore.integrations.sglang` — ``SGLangSync`` with ``EngineApplier`` (in-process
  ``sglang.Engine``) or ``ServerApplier`` (``sglang.launch_server``): follows a store, applies
  the changed tensors, tags ``weight_version`` (rollout side).
- :mod:`deltastore.integrations.adapters` — ``AdapterFollower``: follows an adapter store and
  swaps each version into vLLM or SGLang atomically (rollout side).
- :mod:`deltastore.integrations.rollout` — ``RolloutSidecar`` (``python -m
  deltastore.integrations.rollout``) and ``ServedVersionWorker``: keeps engines on the latest
  version and reports the version actually served into TRL's staleness accounting.
- :mod:`deltastore.integrations.hostcopy` — ``HostCopy``: the host copy the engine integrations
  share, and its all-or-restored swap.
- :mod:`deltastore.integrations.flower` — ``DeltastoreFedAvg``, ``FlowerSite``, ``InlineFedAvg``:
  Flower apps whose messages carry version references instead of weights (server and node side).
"""
