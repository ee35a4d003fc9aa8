"""``fp8:`` -- the precision arm: rollout and trainer FP8 recipes, FP8 implementation, compute dtype."""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl.config.validation import _check_registry, _require

#: ``fp8.compute_dtype`` values: the dtype of everything but FP8 GEMMs (torch dtypes below).
COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp32")


def torch_dtype(name: str):
    """``bf16`` / ``fp32`` -> the torch dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


@dataclass
class Fp8Config:
    """Precision arm: a rollout recipe and a trainer recipe (keys of ``fp8rl.quant.RECIPES``)
    and the compute dtype of everything that is not an FP8 GEMM.

    ``bf16``: no FP8 (both recipes ``bf16``); ``rollout_only``: FP8 rollout recipe, ``bf16``
    trainer; full FP8: both FP8; ``fp32``: no FP8 and fp32 compute (an extra arm: the old mini
    "BF16", which was fp32). ``compute_dtype`` (``bf16`` | ``fp32``) is the dtype the trainer and
    the rollout engine compute in outside FP8 GEMMs: ``bf16`` is BF16 mixed precision as the paper
    trains (fp32 master weights, BF16 activations and high-precision GEMMs with fp32
    accumulation, ``fp8rl.quant.lowp``; FP8 GEMMs quantize from the BF16 values); the BF16 shadow
    of Calibrated Clipping is that forward with FP8 off. ``emulate=True`` computes FP8 by
    quantize-dequantize in high precision (CPU tests); a recipe the hardware cannot run raises,
    naming ``fp8.emulate=true`` as the fix.

    ``impl`` is the trainer's FP8 implementation (``fp8rl.quant.IMPLEMENTATIONS``: ``torchao``,
    ``fp8rl``, ``transformer_engine``), or ``auto`` for the recipe's default
    (``fp8rl.quant.default_impl``): on FP8 kernels tensorwise/rowwise -> torchao (as the paper),
    blockwise and mxfp8 -> transformer_engine, tensorwise_delayed -> transformer_engine; with
    ``emulate=true`` our emulated linear for every recipe (for the torchao recipes with torchao's
    own arithmetic, bit for bit). The issue's ``emulated`` is
    ``emulate=true``. Checked here without hardware: the implementation must express the trainer
    recipe (``fp8rl.quant.resolve_impl``); whether the GPU and Transformer Engine can run it is
    checked when the trainer converts its model, before the first step, naming the fix.
    The rollout engine has its own path (``fp8rl.quant.rollout``) and ignores ``impl``.
    """

    name: str = "bf16"
    rollout_recipe: str = "bf16"
    trainer_recipe: str = "bf16"
    emulate: bool = False
    impl: str = "auto"
    compute_dtype: str = "bf16"

    def __post_init__(self) -> None:
        _require(bool(self.name), "fp8.name must be a non-empty label (e.g. bf16, tensorwise)")
        _require(self.compute_dtype in COMPUTE_DTYPES,
                 f"fp8.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        for f in ("rollout_recipe", "trainer_recipe"):
            _check_registry("fp8rl.quant", "RECIPES", getattr(self, f), f"fp8.{f}")
        from fp8rl.quant import get_recipe, resolve_impl

        try:
            resolve_impl(self.trainer_recipe, self.impl, emulate=self.emulate)
        except (KeyError, ValueError) as e:  # RegistryError is a KeyError
            raise ValueError(
                f"fp8.impl={self.impl!r} cannot run fp8.trainer_recipe={self.trainer_recipe!r} with "
                f"fp8.emulate={str(self.emulate).lower()}: {e}"
            ) from e
        _require(get_recipe(self.rollout_recipe).scaling == "dynamic",
                 f"fp8.rollout_recipe={self.rollout_recipe!r} uses delayed scaling, a training "
                 f"recipe; the rollout engine quantizes with dynamic scales (vLLM's fp8 online "
                 f"mode): use fp8.rollout_recipe=tensorwise")
        self._check_name_matches_recipes()

    def _check_name_matches_recipes(self) -> None:
        """The arm name goes into run names and figure legends: it must say what runs.

        ``bf16`` means both recipes bf16; ``rollout_only`` an FP8 rollout recipe with a bf16
        trainer; a recipe name (``tensorwise``, ``blockwise``, ...) full FP8 with that trainer
        recipe and an FP8 rollout recipe. Any other name is a free label for a custom arm.
        """
        from fp8rl.quant import RECIPES

        name, rollout, trainer = self.name, self.rollout_recipe, self.trainer_recipe
        how = "(the launcher's fp8=<arm> config group sets these together)"
        if name == "fp32":
            _require(rollout == "bf16" and trainer == "bf16" and self.compute_dtype == "fp32",
                     f"fp8.name='fp32' needs no FP8 (fp8.rollout_recipe=bf16, fp8.trainer_recipe=bf16) "
                     f"and fp8.compute_dtype=fp32, got rollout {rollout!r}, trainer {trainer!r}, compute "
                     f"{self.compute_dtype!r} {how}")
            return
        if name in ("bf16", "rollout_only") or name in RECIPES:
            _require(self.compute_dtype == "bf16",
                     f"fp8.name={name!r} computes in BF16 outside FP8 GEMMs; fp8.compute_dtype="
                     f"{self.compute_dtype!r} would run something else under that name: use "
                     f"fp8=fp32 for the fp32 arm, or give a custom arm its own fp8.name")
        if name == "bf16":
            _require(rollout == "bf16" and trainer == "bf16",
                     f"fp8.name='bf16' needs fp8.rollout_recipe=bf16 and fp8.trainer_recipe=bf16, "
                     f"got rollout {rollout!r}, trainer {trainer!r} {how}")
        elif name == "rollout_only":
            _require(trainer == "bf16" and rollout != "bf16",
                     f"fp8.name='rollout_only' needs an FP8 fp8.rollout_recipe and "
                     f"fp8.trainer_recipe=bf16, got rollout {rollout!r}, trainer {trainer!r} {how}")
        elif name in RECIPES:
            _require(trainer == name and rollout != "bf16",
                     f"fp8.name={name!r} names the full-FP8 {name} arm: set "
                     f"fp8.trainer_recipe={name} and an FP8 fp8.rollout_recipe (e.g. "
                     f"fp8.rollout_recipe={'tensorwise' if name == 'tensorwise_delayed' else name}), "
                     f"got rollout {rollout!r}, trainer {trainer!r} {how}")
