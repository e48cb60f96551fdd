"""Transformer-shaped models for the large benchmark workloads, built from a config.

The MiniLM workloads use a real pretrained model, but it is small (45 MB in bf16, 103 tensors,
64 of them under 10k elements). Throughput and memory goals are stated for models of 500 MB and
more, whose tensors are LLM-shaped, so these workloads use a decoder-only Llama-architecture
model (``transformers.LlamaForCausalLM``: token embeddings, per layer RMSNorm, attention
q/k/v/o with grouped-query k/v, a SwiGLU MLP gate/up/down, a final norm and an untied LM head),
randomly initialised with the library's usual init (normal, std 0.02, norms at 1). Nothing is
downloaded. The vocabulary is the MiniLM tokenizer's (30,522, close to Llama-2's 32,000) so the
workloads train on the same real-text tokens.
"""

from __future__ import annotations

import dataclasses

import torch

# Llama's initializer_range: every linear and embedding weight ~ N(0, 0.02). What matters for
# the workloads is the weights' magnitude, since a bf16 element changes when an update of ~lr
# crosses half a unit in the last place of |w|; 0.02 is also the typical |w| of trained LLMs.
INIT_STD = 0.02
# Enough positions for the workloads' sequences; RoPE has no position parameters, so this
# does not change the state dict.
MAX_POSITIONS = 512


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The shape of a Llama-architecture decoder-only transformer."""

    name: str
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    tie_embeddings: bool = False

    def n_params(self) -> int:
        """Number of parameters (= elements of the exported state dict)."""
        head_dim = self.d_model // self.n_heads
        attn = 2 * self.d_model * self.d_model + 2 * self.d_model * self.n_kv_heads * head_dim
        mlp = 3 * self.d_model * self.d_ff
        norms = 2 * self.d_model
        emb = self.vocab * self.d_model * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + norms) + emb + self.d_model

    def build(self, seed: int) -> torch.nn.Module:
        """A randomly initialised fp32 ``LlamaForCausalLM`` of this shape (seeded)."""
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.d_model,
            intermediate_size=self.d_ff,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            tie_word_embeddings=self.tie_embeddings,
            max_position_embeddings=MAX_POSITIONS,
            initializer_range=INIT_STD,
            use_cache=False,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        n = sum(p.numel() for p in model.parameters())
        if n != self.n_params():  # the shape arithmetic documents the model; keep it honest
            raise RuntimeError(f"{self.name}: built {n} parameters, shape says {self.n_params()}")
        return model


# 30,522: the vocabulary of the MiniLM (BERT uncased) tokenizer the workloads tokenize with.
_VOCAB = 30522

SHAPES: dict[str, DecoderShape] = {
    s.name: s
    for s in (
        # ~125M parameters (245 MB in bf16): GPT-2-small / Llama-style width and depth, SwiGLU
        # MLP at Llama's 8/3 d_model, grouped-query attention with 4 k/v heads as in Llama 3.
        DecoderShape("tf125m", vocab=_VOCAB, d_model=768, n_layers=12, n_heads=12,
                     n_kv_heads=4, d_ff=2048),
        # ~265M parameters (530 MB in bf16): the "≥ 500 MB transformer-shaped model" of the
        # pipeline and performance goals; Llama's d_ff = 8/3 d_model rounded up to 256.
        DecoderShape("tf265m", vocab=_VOCAB, d_model=1024, n_layers=18, n_heads=16,
                     n_kv_heads=4, d_ff=2816),
    )
}
