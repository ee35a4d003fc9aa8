"""Rounding modes of a GEMM operand and the seeded state behind stochastic rounding.

``ROUNDINGS``: how an operand's elements land on the element grid once scaled,

- ``nearest``: round to nearest, ties to even (every recipe's default; the FP8 casts' rounding);
- ``stochastic``: round to one of the two neighbouring grid values, up with probability
  ``(a - lo) / step`` (``formats.round_magnitudes_stochastic_``), so the rounding is unbiased
  in expectation. NVIDIA's NVFP4 training recipe ("Pretraining Large Language Models with NVFP4",
  arXiv:2509.25149 section 4.4; Transformer Engine's ``NVFP4BlockScaling``: ``fp4_quant_bwd_grad``
  has ``stochastic_rounding=True``, inputs and weights do not) rounds the gradients so, the
  forward operands to nearest. Only FP4/FP6 operands (``fp8rl.quant.microscale``) take it here.

**Seeded and checkpointed.** The draws come from a ``torch.Generator`` owned by a
:class:`QuantizerState`, never from the global RNG: ``convert_to_fp8(..., seed=)`` makes one per
converted model (the mini trainer seeds it from the run seed) and hands it to every FP8 layer;
its state goes into the mini checkpoint (``fp8rl.backends.mini.checkpoint``), so a resumed run
draws the same rounding noise as one that never stopped. A recipe with a stochastic operand and
no state refuses to run (``stochastic_generator``), so no draw is ever unseeded.

Choices [G]: one generator per model, drawn in the order autograd runs the layers' backward
passes (deterministic on CPU; on several GPUs each rank would need its own stream); one uniform
float32 draw per element, padding of ragged blocks included; the block scales are rounded to
nearest even (TE rounds the E4M3 scales the same way; stochastic rounding is for the elements).
"""

from __future__ import annotations

import torch

__all__ = ["ROUNDINGS", "QuantizerState", "model_quantizer_state", "stochastic_generator"]

#: ``OperandConfig.rounding`` values.
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
#: The attribute of a converted layer that holds the model's :class:`QuantizerState`.
STATE_ATTR = "quant_state"


class QuantizerState:
    """The random state of a model's quantizers: one seeded ``torch.Generator``.

    ``state_dict()`` -> ``{"seed": int, "rng": uint8 tensor}`` (tensors and plain data: the mini
    checkpoint loads it with ``weights_only=True``); ``load_state_dict`` restores the stream.
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"QuantizerState seed must be an int >= 0 (the run seed), got {seed!r}")
        self.seed = seed
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"quantizer state saved with seed {state['seed']}, this model's is {self.seed}: "
                             "a checkpoint resumes the run that wrote it, with the same seed")
        self.generator.set_state(state["rng"])


def stochastic_generator(recipe, state: QuantizerState | None) -> torch.Generator | None:
    """The generator the recipe's stochastic operands draw from (``None`` when it has none).

    Raises ``ValueError`` for a recipe with a stochastic operand and no state: rounding noise
    must come from a seeded, checkpointed stream, never the global RNG."""
    if not recipe.stochastic:
        return None
    if state is None:
        raise ValueError(
            f"recipe {recipe.name!r} rounds operands stochastically, which needs a seeded quantizer state: "
            f"convert the model with convert_to_fp8(..., seed=<run seed>) (or pass quant_state=)")
    return state.generator


def model_quantizer_state(model: torch.nn.Module) -> QuantizerState | None:
    """The :class:`QuantizerState` shared by ``model``'s FP8 layers, or ``None``."""
    for m in model.modules():
        state = getattr(m, STATE_ATTR, None)
        if isinstance(state, QuantizerState):
            return state
    return None
