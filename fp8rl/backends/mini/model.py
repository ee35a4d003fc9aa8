"""Tiny Qwen3-architecture models for the three model slots of the grid.

The paper's models are Qwen3-8B-Base, Qwen3-14B-Base and Qwen2.5-32B; the mini backend maps
the slots ``8b`` < ``14b`` < ``32b`` to three tiny ``transformers`` ``Qwen3ForCausalLM`` models,
smallest to largest (101k, 158k, 226k parameters), sized so that the main-table grid (a third
of its cells per slot) fits about 60 s per run on a 2-core CPU (``docs/mini.md`` has the
measured times). All three have 2 layers and differ in width: at these sizes a CPU step is
dominated by per-operator overhead, which grows with depth, not width (a 96-wide 3-layer
model measured ~3x the step time of the 64-wide 2-layer one). Choices:

- fp32 master weights (the "BF16" arm of the paper is our high-precision arm; on CPU we run
  it in fp32, so "bf16" below always means "no FP8");
- **untied** embeddings and LM head (``tie_word_embeddings=False``): the LM head stays in high
  precision under every FP8 recipe (MiniMax-M1's finding, see ``reference/paper.md``), and
  untying keeps the FP8 conversion of the body from touching the embedding table;
- eager attention (deterministic on CPU and works with ``fp8rl.quant``'s linear swaps);
- ``head_dim = hidden / heads``, grouped-query attention with ``kv_heads = heads / 2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8rl.config.model import MODEL_SLOTS
from fp8rl.registry import Registry


@dataclass(frozen=True)
class ModelDims:
    """Dimensions of one tiny Qwen3 model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")


#: The mini model of each slot (the slots themselves: ``fp8rl.config.MODEL_SLOTS``, defined once).
MINI_MODELS: Registry[ModelDims] = Registry("mini model slot")
MINI_MODELS.add("8b", ModelDims(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192))
MINI_MODELS.add("14b", ModelDims(hidden=80, layers=2, heads=4, kv_heads=2, intermediate=240))
MINI_MODELS.add("32b", ModelDims(hidden=96, layers=2, heads=4, kv_heads=2, intermediate=288))
assert sorted(MINI_MODELS.names()) == sorted(MODEL_SLOTS), "a mini model for every slot of fp8rl.config.MODEL_SLOTS"


def build_model(slot: str, vocab_size: int, *, max_positions: int, seed: int) -> torch.nn.Module:
    """A freshly initialised fp32 ``Qwen3ForCausalLM`` for ``slot`` (deterministic in ``seed``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = MINI_MODELS[slot]
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=d.hidden,
        intermediate_size=d.intermediate,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=d.hidden // d.heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    return model.float()


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
