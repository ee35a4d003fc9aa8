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
        _require(isinstance(self.name, str) and bool(self.name),
                 "fp8.name must be an FP8 arm's name (e.g. bf16, tensorwise); pick the arm with fp8=NAME")
        _require(self.compute_dtype in COMPUTE_DTYPES,
                 f"fp8.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        for f in ("rollout_recipe", "trainer_recipe"):
            _check_registry("fp8rl.quant", "RECIPES", getattr(self, f), f"fp8.{f}")
        from fp8rl.quant import resolve_impl

        try:
            resolve_impl(self.trainer_recipe, self.impl, emulate=self.emulate)
        except (KeyError, ValueError) as e:  # RegistryError is a KeyError
            raise ValueError(
                f"fp8.impl={self.impl!r} cannot run fp8.trainer_recipe={self.trainer_recipe!r} with "
                f"fp8.emulate={str(self.emulate).lower()}: {e}"
            ) from e
        _require(self.rollout.scaling == "dynamic",
                 f"fp8.rollout_recipe={self.rollout_recipe!r} uses delayed scaling, a training "
                 f"recipe; the rollout engine quantizes with dynamic scales (vLLM's fp8 online "
                 f"mode): use fp8.rollout_recipe=tensorwise")
        self._check_name_matches_recipes()

    @property
    def rollout(self):
        """The rollout recipe (an ``fp8rl.quant.Recipe``; ``rollout_recipe`` names it)."""
        from fp8rl.quant import get_recipe

        return get_recipe(self.rollout_recipe)

    @property
    def trainer(self):
        """The trainer recipe (an ``fp8rl.quant.Recipe``; ``trainer_recipe`` names it)."""
        from fp8rl.quant import get_recipe

        return get_recipe(self.trainer_recipe)

    def _check_name_matches_recipes(self) -> None:
        """The arm name goes into run names and figure legends: it must say what runs
        (:func:`fp8_arms` owns the rule)."""
        arms = fp8_arms()
        _require(self.name in arms,
                 f"fp8.name: {self.name!r} is not an FP8 arm; valid values: {', '.join(arms)} (pick the arm "
                 f"with fp8=NAME; an arm is named after what it runs, so a new one is a new recipe)")
        problem = arms[self.name].problem(self)
        _require(problem is None, problem or "")


@dataclass(frozen=True)
class Fp8Arm:
    """What an ``fp8=`` arm's name promises about the recipes and dtype that run under it.

    Attributes:
        name: the ``fp8.name`` (a run-name part and a legend label).
        rollout: the rollout recipe: a ``RECIPES`` name, or ``FP8`` for any recipe but ``bf16``.
        trainer: the trainer recipe (a ``RECIPES`` name).
        compute_dtype: ``fp8.compute_dtype`` (``COMPUTE_DTYPES``).
    """

    name: str
    rollout: str
    trainer: str
    compute_dtype: str = "bf16"

    def problem(self, cfg: Fp8Config) -> str | None:
        """Why ``cfg`` does not run what its name says, with the fix; None when it does."""
        how = "(the launcher's fp8=<arm> config group sets these together)"
        rollout, trainer, name = cfg.rollout_recipe, cfg.trainer_recipe, self.name
        if self.compute_dtype == "fp32":
            if (rollout, trainer, cfg.compute_dtype) != ("bf16", "bf16", "fp32"):
                return (f"fp8.name='fp32' needs no FP8 (fp8.rollout_recipe=bf16, fp8.trainer_recipe=bf16) and "
                        f"fp8.compute_dtype=fp32, got rollout {rollout!r}, trainer {trainer!r}, compute "
                        f"{cfg.compute_dtype!r} {how}")
            return None
        if cfg.compute_dtype != self.compute_dtype:
            return (f"fp8.name={name!r} computes in BF16 outside FP8 GEMMs; fp8.compute_dtype="
                    f"{cfg.compute_dtype!r} would run something else under that name: use fp8=fp32 for the "
                    f"fp32 arm")
        rollout_ok = rollout != "bf16" if self.rollout == FP8 else rollout == self.rollout
        if rollout_ok and trainer == self.trainer:
            return None
        if name == "bf16":
            return (f"fp8.name='bf16' needs fp8.rollout_recipe=bf16 and fp8.trainer_recipe=bf16, "
                    f"got rollout {rollout!r}, trainer {trainer!r} {how}")
        if name == "rollout_only":
            return (f"fp8.name='rollout_only' needs an FP8 fp8.rollout_recipe and fp8.trainer_recipe=bf16, "
                    f"got rollout {rollout!r}, trainer {trainer!r} {how}")
        example = "tensorwise" if name == "tensorwise_delayed" else name
        return (f"fp8.name={name!r} names the full-FP8 {name} arm: set fp8.trainer_recipe={name} and an FP8 "
                f"fp8.rollout_recipe (e.g. fp8.rollout_recipe={example}), got rollout {rollout!r}, trainer "
                f"{trainer!r} {how}")


#: ``Fp8Arm.rollout`` for "any FP8 rollout recipe".
FP8 = "FP8"


def fp8_arms():
    """The ``fp8=`` arms (a ``Registry`` of :class:`Fp8Arm`): ``fp32`` (no FP8, fp32 compute),
    ``bf16`` (no FP8), ``rollout_only`` (FP8 rollout, BF16 trainer), and one full-FP8 arm per
    FP8 recipe of ``fp8rl.quant.RECIPES``, named after it (it trains with it; rolls out in FP8).
    Built on each call, so that a recipe registered later has its arm."""
    from fp8rl.quant import RECIPES
    from fp8rl.registry import Registry

    arms: Registry[Fp8Arm] = Registry("FP8 arm")
    arms.add("fp32", Fp8Arm("fp32", "bf16", "bf16", "fp32"))
    arms.add("bf16", Fp8Arm("bf16", "bf16", "bf16"))
    arms.add("rollout_only", Fp8Arm("rollout_only", FP8, "bf16"))
    for recipe in sorted(RECIPES):
        if recipe != "bf16":
            arms.add(recipe, Fp8Arm(recipe, FP8, recipe))
    return arms
