"""Noise audit: how much FP8 noise each recipe puts into log-probs and into the PPO ratio.

The paper's mechanism (abstract; ``reference/paper.md`` "The claim"): FP8 quantization noise
distorts the PPO ratio ``r = pi_theta / pi_old`` and pushes negative-advantage tokens below the
lower clip bound ``1 - eps_low``, where their gradient is zero. This tool measures that noise on
any causal LM, for a list of recipes, without training:

1. Sample ``num_seqs`` sequences (random prompts, ``response_len`` sampled tokens) from the
   high-precision model ``theta_0``; the response tokens are the measured tokens.
2. **Log-prob mismatch** at ``theta_0``: ``d = logp_fp8 - logp_hp`` per token; report mean
   ``|d|``, ``std(d)`` and the k3 estimator of ``KL(pi_hp || pi_fp8)``:
   ``mean(exp(d) - 1 - d)`` (samples come from the high-precision model).
3. **Ratio noise after one small optimizer step**: compute one update ``delta`` from the
   high-precision model (AdamW, a policy-gradient surrogate ``-mean(A * logp)`` with random
   +-1 sequence advantages, GRPO-like) and apply the *same* ``delta`` to the master weights of
   both models. Then ``r = exp(logp(theta_1) - logp(theta_0))`` in each precision (FP8 model:
   both log-probs in FP8, as a full-FP8 trainer computes them). Report ``std(r - 1)`` and the
   fractions of tokens with ``r < clip_low`` (0.8) and ``r > clip_high`` (1.28) in each precision.

The **reference precision is BF16 mixed precision** (``dtype="bfloat16"``, the default), as the
paper's baseline and the mini backend's ``bf16`` arm compute: the weights live in an fp32 master
copy; every measured model is that master cast to BF16 (FP8 recipes then convert the BF16
model, quantizing from the BF16 weights); the update is applied to the fp32 master and the
models are re-cast. The ``bf16`` row is the control: its "FP8" model is the BF16 model, so its
mismatch is 0 and its ratio noise equals the reference's. ``dtype="float32"`` audits against an
fp32 reference instead (fp32 compute everywhere, the FP8 models included).

Choices made here [G] (the paper gives no protocol for this measurement):
- one AdamW step (``lr`` 1e-5 default, betas (0.9, 0.999), no weight decay) on random
  +-1 advantages stands for "a small policy update"; the high-precision ratio std it produces
  is reported so the step size can be judged;
- the tiny random model is initialised with std 0.1 (Qwen3's default ``initializer_range`` is
  0.02): at 0.02 a 128-wide random model's logits are nearly uniform (std ~0.2), unlike a trained
  LM's, and the FP8 log-prob mismatch is 10x smaller (measured: std 0.016 vs 0.16); 0.1 gives
  sharper, more LM-like distributions. ``init_std`` is an option; the docs report both;
- the ratio-noise multiple depends on the step size: the FP8 noise floor is roughly fixed by the
  weight-rounding flips, while the high-precision ratio noise scales with ``lr`` (docs: sweep);
- the reference and every FP8 model compute in ``dtype`` (BF16 by default) on fp32 masters;
- the FP4 / FP6 recipes (``nvfp4``, ``nvfp4_rn``, ``w4a16``, ``mxfp4``, ``mxfp6``; ``fp8rl.quant.microscale``) are measured
  exactly as the FP8 ones (their "FP8" columns then hold the FP4/FP6 model's numbers); they have
  no kernels, so they need ``emulate=True``;
- FP8 GEMMs are emulated by default (``emulate=True``): the audit measures numerics, and
  emulation equals an FP8 kernel up to float32 accumulation order; ``emulate=False`` uses
  ``torch._scaled_mm`` where the recipe allows and raises where it does not.
"""

from __future__ import annotations

import copy
import csv
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from fp8rl.quant.convert import convert_to_fp8
from fp8rl.quant.recipes import RECIPES, get_recipe

__all__ = ["AuditConfig", "AuditRow", "build_tiny_qwen3", "format_table", "run_audit", "write_csv"]

DEFAULT_RECIPES = ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise", "mxfp8", "nvfp4", "nvfp4_rn",
                   "w4a16", "mxfp4", "mxfp6")


@dataclass(frozen=True)
class AuditConfig:
    """Settings of one audit run (see the module docstring)."""

    recipes: tuple[str, ...] = DEFAULT_RECIPES
    model: str | None = None  # local HF causal-LM path; None = tiny random Qwen3
    num_seqs: int = 32
    prompt_len: int = 8
    response_len: int = 32
    lr: float = 1e-5
    clip_low: float = 0.8
    clip_high: float = 1.28
    seed: int = 0
    emulate: bool = True
    dtype: str = "bfloat16"
    hybrid: bool | None = None
    init_std: float = 0.1  # tiny random model only

    def __post_init__(self) -> None:
        for name in self.recipes:
            RECIPES.check(name)
        if self.num_seqs < 1 or self.prompt_len < 1 or self.response_len < 1:
            raise ValueError("num_seqs, prompt_len and response_len must be >= 1")
        if not (0 < self.clip_low < 1 < self.clip_high):
            raise ValueError(f"need 0 < clip_low < 1 < clip_high, got {self.clip_low}, {self.clip_high}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


@dataclass
class AuditRow:
    """One recipe's measurements (column names of the CSV)."""

    recipe: str
    n_tokens: int
    lp_absdiff_mean: float
    lp_diff_std: float
    k3_kl: float
    hp_ratio_std: float
    fp8_ratio_std: float
    noise_x: float
    hp_frac_below_low: float
    fp8_frac_below_low: float
    hp_frac_above_high: float
    fp8_frac_above_high: float
    seconds: float = field(default=0.0)


def build_tiny_qwen3(
    seed: int = 0, *, vocab_size: int = 64, hidden: int = 128, layers: int = 2, init_std: float = 0.1
) -> nn.Module:
    """A random Qwen3-architecture causal LM (default ~0.4M parameters, untied LM head).

    ``init_std`` is Qwen3's ``initializer_range``; see ``AuditConfig.init_std`` for why 0.1.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=init_std,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


def _load_model(cfg: AuditConfig) -> nn.Module:
    """The fp32 master model."""
    if cfg.model is None:
        model = build_tiny_qwen3(cfg.seed, init_std=cfg.init_std)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.model)
    return model.float().eval()


def _compute_model(master: nn.Module, recipe, cfg: AuditConfig) -> nn.Module:
    """The model a trainer computes with: the master cast to ``cfg.dtype``, then FP8 per ``recipe``."""
    model = copy.deepcopy(master).to(getattr(torch, cfg.dtype)).eval()
    return convert_to_fp8(model, recipe, emulate=cfg.emulate, seed=cfg.seed) if recipe.enabled else model


def _vocab_size(model: nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


@torch.no_grad()
def sample_sequences(model: nn.Module, cfg: AuditConfig) -> torch.Tensor:
    """``[num_seqs, prompt_len + response_len]`` token ids: random prompts + sampled responses."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    vocab = _vocab_size(model)
    ids = torch.randint(0, vocab, (cfg.num_seqs, cfg.prompt_len), generator=gen)
    for _ in range(cfg.response_len):  # explicit loop: seeded, no generation-config surprises
        logits = model(input_ids=ids).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def response_log_probs(model: nn.Module, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs of the response tokens, ``[B, T_resp]`` float32."""
    logits = model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)


def _update_delta(model: nn.Module, ids: torch.Tensor, cfg: AuditConfig) -> dict[str, torch.Tensor]:
    """One AdamW step on ``-mean(A * logp)`` (random +-1 advantages); returns the weight change."""
    work = copy.deepcopy(model).train()
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    adv = torch.randint(0, 2, (ids.shape[0], 1), generator=gen).float() * 2 - 1
    opt = torch.optim.AdamW(work.parameters(), lr=cfg.lr, weight_decay=0.0)
    loss = -(adv * response_log_probs(work, ids, cfg.prompt_len)).mean()
    loss.backward()
    before = {k: v.detach().clone() for k, v in work.state_dict().items()}
    opt.step()
    return {k: v.detach() - before[k] for k, v in work.state_dict().items() if not torch.equal(v, before[k])}


@torch.no_grad()
def _apply_delta(model: nn.Module, delta: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    missing = [k for k in delta if k not in state]
    if missing:
        raise KeyError(f"converted model lost parameters {missing[:3]}")
    for k, d in delta.items():
        state[k].add_(d)


def _ratio_stats(lp_new: torch.Tensor, lp_old: torch.Tensor, cfg: AuditConfig) -> tuple[float, float, float]:
    r = torch.exp(lp_new - lp_old).flatten().double()
    return (float((r - 1).std()), float((r < cfg.clip_low).double().mean()),
            float((r > cfg.clip_high).double().mean()))


def run_audit(cfg: AuditConfig, model: nn.Module | None = None) -> list[AuditRow]:
    """Measure log-prob mismatch and PPO-ratio noise for every recipe in ``cfg.recipes``.

    Args:
        cfg: settings.
        model: optional causal LM (``model(input_ids=...).logits``) whose weights are taken as
            the fp32 master; default from ``cfg.model``. It is not modified.
    """
    master = (_load_model(cfg) if model is None else model).float().eval()
    control = get_recipe("bf16")
    ref_old = _compute_model(master, control, cfg)
    ids = sample_sequences(ref_old, cfg)
    with torch.no_grad():
        lp_hp_old = response_log_probs(ref_old, ids, cfg.prompt_len)
    delta = _update_delta(master, ids, cfg)
    master_new = copy.deepcopy(master)
    _apply_delta(master_new, delta)
    with torch.no_grad():
        lp_hp_new = response_log_probs(_compute_model(master_new, control, cfg), ids, cfg.prompt_len)
    hp_std, hp_lo, hp_hi = _ratio_stats(lp_hp_new, lp_hp_old, cfg)

    rows = []
    for name in cfg.recipes:
        t0 = time.perf_counter()
        recipe = get_recipe(name, hybrid=cfg.hybrid)
        with torch.no_grad():
            lp_old = response_log_probs(_compute_model(master, recipe, cfg), ids, cfg.prompt_len)
            lp_new = response_log_probs(_compute_model(master_new, recipe, cfg), ids, cfg.prompt_len)
        d = (lp_old - lp_hp_old).flatten().double()
        std, lo, hi = _ratio_stats(lp_new, lp_old, cfg)
        rows.append(AuditRow(
            recipe=recipe.short_str(), n_tokens=d.numel(),
            lp_absdiff_mean=float(d.abs().mean()), lp_diff_std=float(d.std()),
            k3_kl=float((torch.exp(d) - 1 - d).mean()),
            hp_ratio_std=hp_std, fp8_ratio_std=std,
            noise_x=std / hp_std if hp_std > 0 else math.inf,
            hp_frac_below_low=hp_lo, fp8_frac_below_low=lo,
            hp_frac_above_high=hp_hi, fp8_frac_above_high=hi,
            seconds=time.perf_counter() - t0,
        ))
    return rows


_COLUMNS = [
    ("recipe", "{}"), ("n_tokens", "{}"), ("lp_absdiff_mean", "{:.4f}"), ("lp_diff_std", "{:.4f}"),
    ("k3_kl", "{:.2e}"), ("hp_ratio_std", "{:.4f}"), ("fp8_ratio_std", "{:.4f}"), ("noise_x", "{:.1f}"),
    ("hp_frac_below_low", "{:.4f}"), ("fp8_frac_below_low", "{:.4f}"),
    ("hp_frac_above_high", "{:.4f}"), ("fp8_frac_above_high", "{:.4f}"), ("seconds", "{:.1f}"),
]


def format_table(rows: list[AuditRow]) -> str:
    """A Markdown table of the rows (what the CLI prints and the docs show)."""
    head = "| " + " | ".join(c for c, _ in _COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    body = ["| " + " | ".join(f.format(getattr(r, c)) for c, f in _COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_csv(rows: list[AuditRow], path: str | Path, cfg: AuditConfig | None = None) -> Path:
    """Write the rows (plus the config as ``cfg_*`` columns, if given) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {f"cfg_{k}": (";".join(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()} if cfg else {}
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*asdict(rows[0]), *extra])
        writer.writeheader()
        for r in rows:
            writer.writerow({**asdict(r), **extra})
    return path

