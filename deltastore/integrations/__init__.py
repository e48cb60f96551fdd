"""Glue between deltastore and the frameworks around it (docs/integrations.md).

Each submodule imports its framework lazily and only when used; ``import deltastore`` never
imports any of them:

- :mod:`deltastore.integrations.trl` — ``DeltastoreWeightTransfer``, a TRL
  ``WeightTransferProtocol`` backend for ``AsyncGRPOTrainer`` (trainer side).
- :mod:`deltastore.integrations.transformers` — ``DeltastoreCallback``, publishing from a
  ``transformers.Trainer`` (trainer side).
- :mod:`deltastore.integrations.vllm` — ``DeltastoreWorkerExtension``, a vLLM worker extension
  that follows a store and reloads only the changed tensors (rollout side).
"""
