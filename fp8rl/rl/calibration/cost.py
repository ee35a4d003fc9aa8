"""What each calibration mode costs at paper scale: its extra work per optimizer step, relative to
the FP8 optimizer step it rides on, counted in GEMM FLOPs and priced in GEMM time.

Pure arithmetic (no torch): ``python -m experiments.calibration_cost`` prints the tables that
``docs/benchmarks.md`` ("Calibration cost at paper scale") shows, on the configs the paper-scale dry
run composes (the caller composes them: this library imports no launcher).

**The FP8 optimizer step as it runs** (OpenRLHF 0.11.2, ``docs/cluster.md``), per sequence of L
tokens (prompt + response, every token through every pass; packed samples, so no padding):

- the old log-probs: one no-grad forward of the FP8 policy (its linears FP8, the LM head and
  attention BF16), every sequence once per RL step;
- the reference model's forward only when the config has a KL term (``algorithm.kl_coef > 0``;
  the paper-scale cells pass ``--algo.kl.init_coef 0``, so OpenRLHF builds no reference model);
- the training forward and its backward (each GEMM twice more: input and weight gradients);
- with gradient checkpointing (``openrlhf.gradient_checkpointing``, on at paper scale) one more
  forward of the decoder layers during the backward (the LM head sits outside the checkpointed
  layers and is not recomputed). Both settings are modelled: ``checkpointing`` on and off.

Every term scales with the sequences it covers, and an RL step is ``num_mini_batches`` optimizer
steps over the same sequences, so a ratio per optimizer step equals the ratio per RL step.
Micro-batch sizes (``openrlhf.micro_train_batch_size``, ``logprob_micro_batch``) change how many
forward calls a rank makes, not the FLOPs: they are recorded in :class:`StepShape`, not counted.

**Each mode's extra work** (no-grad forwards; "BF16" = the shadow, the FP8 linears switched off;
``plugin/binding/calibrate.py`` for the schedules):

- ``periodic``: on every ``period``-th step, the BF16 old log-probs and a BF16 forward of every
  micro-batch on its current weights: 2 BF16 forwards of the step's sequences every K steps;
- ``pooled``: the same every step;
- ``same_batch``: the BF16 old log-probs, then per optimizer step a no-grad pre-pass of every
  micro-batch in FP8 (the bounds' FP8 ratios) and in BF16: 2 BF16 + 1 FP8 forwards every step;
- ``sampled``: 2 BF16 forwards (old and current) of a share ``share`` of the step's sequences
  every step; their FP8 ratios are the loss's own forward, so no FP8 pass is added.

**Counted**: GEMM FLOPs (2 per multiply-add) of the linear layers (q, k, v, o, gate, up, down:
:meth:`ModelShape.linear_flops`), the LM head over every position (OpenRLHF's actor computes the
logits of the whole sequence) and causal attention's score and value products (QK^T and AV over
the L (L + 1) / 2 query-key pairs; :meth:`ModelShape.attention_flops`). A backward counts 2x its
forward's FLOPs, attention's too. **Priced**: FP8 GEMMs (the policy's linears) at rate R, BF16
GEMMs (the LM head, attention everywhere, the shadow's linears, a reference model) at R / 2 --
the dense FP8 to BF16 tensor-core ratio of H100-class GPUs. A time ratio is that GEMM time's
ratio; what the model leaves out adds to both sides of a step and lowers the real ratio.

Where we guessed (each an argument with a stated default):

- every sequence has the mean length: ``prompt_len`` (default :data:`DEFAULT_PROMPT_LEN`, 256: our
  prompts run about 100-300 tokens with the chat template) plus ``response_share`` of the response
  cap (default :data:`DEFAULT_RESPONSE_SHARE`, half; ``docs/benchmarks.md`` shows a quarter and
  the whole cap). Attention grows with L squared, so equal lengths understate it a little;
- left out: element-wise work, the optimizer, ZeRO-3's parameter gathers (each extra forward
  gathers the weights again), flash attention's recomputation of scores in its backward, and the
  rollout (generation) that precedes every step, a large share of a step's wall time at 16-20K
  tokens;
- the model shapes (:data:`MODELS`) are those of the models' ``config.json`` as Qwen publishes
  them on the Hugging Face Hub: Qwen/Qwen3-8B-Base (36 layers, hidden 4096, intermediate 12288,
  32 heads, 8 KV heads, head dim 128, vocabulary 151936), Qwen/Qwen3-14B-Base (40, 5120, 17408,
  40, 8, 128, 151936) and Qwen/Qwen2.5-32B (64, 5120, 27648, 40, 8, 128 = 5120 / 40, 152064); none
  ties its embeddings; biases (Qwen2.5's q, k, v) are not GEMMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_PROMPT_LEN",
    "DEFAULT_RESPONSE_SHARE",
    "MODELS",
    "MODES",
    "PAPER_CELLS",
    "ModelShape",
    "StepShape",
    "Work",
    "cost_table",
    "extra_work",
    "markdown",
    "max_share",
    "overhead",
    "paper_shapes",
    "sensitivity_table",
    "step_work",
]

#: The calibration modes the model prices (``fp8rl.rl.calibration.CALIBRATION_MODES``).
MODES = ("periodic", "pooled", "windowed", "same_batch", "sampled")
#: Assumed mean prompt length in tokens (chat template included).
DEFAULT_PROMPT_LEN = 256
#: Assumed mean response length as a share of the response cap.
DEFAULT_RESPONSE_SHARE = 0.5
#: The extra cost a cheap calibration mode may add (issue: <= 5% of an FP8 optimizer step).
DEFAULT_BUDGET = 0.05
#: BF16 GEMMs run at 1 / this of the FP8 rate.
BF16_SLOWDOWN = 2.0
#: The FP8 paper's model and algorithm pairs (docs/cluster.md): the rows of the tables.
PAPER_CELLS = {"8b": "grpo", "14b": "dapo", "32b": "grpo"}


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's GEMM shapes (grouped-query attention, SwiGLU MLP, untied LM head)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            _positive_int(f"ModelShape.{f}", getattr(self, f))
        if self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    def linear_flops(self, tokens: float) -> float:
        """Forward FLOPs of every decoder layer's linears over ``tokens`` tokens."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        return 2.0 * self.layers * (attn + mlp) * tokens

    def head_flops(self, tokens: float) -> float:
        """Forward FLOPs of the LM head over ``tokens`` positions."""
        return 2.0 * self.hidden * self.vocab * tokens

    def attention_flops(self, seq_len: float) -> float:
        """Forward FLOPs of causal QK^T and AV of one sequence of ``seq_len`` tokens, all layers."""
        return 2.0 * self.layers * self.heads * self.head_dim * seq_len * (seq_len + 1)


#: Slot -> shape, from the models' published config.json (module docstring).
MODELS = {
    "8b": ModelShape("Qwen3-8B-Base", layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8,
                     head_dim=128, vocab=151936),
    "14b": ModelShape("Qwen3-14B-Base", layers=40, hidden=5120, intermediate=17408, heads=40, kv_heads=8,
                      head_dim=128, vocab=151936),
    "32b": ModelShape("Qwen2.5-32B", layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8,
                      head_dim=128, vocab=152064),
}


@dataclass(frozen=True)
class Work:
    """GEMM FLOPs split by the precision they run in."""

    fp8: float = 0.0
    bf16: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.fp8 + other.fp8, self.bf16 + other.bf16)

    def __mul__(self, k: float) -> Work:
        return Work(self.fp8 * k, self.bf16 * k)

    __rmul__ = __mul__

    @property
    def flops(self) -> float:
        return self.fp8 + self.bf16

    @property
    def time(self) -> float:
        """GEMM time in units of 1 / R (FP8 at R, BF16 at R / :data:`BF16_SLOWDOWN`)."""
        return self.fp8 + BF16_SLOWDOWN * self.bf16


@dataclass(frozen=True)
class StepShape:
    """The batch of one RL step and the assumed sequence length.

    Attributes:
        sequences: sequences per RL step (``prompts_per_step x n_samples_per_prompt``).
        num_mini_batches: optimizer steps per RL step.
        prompt_len, response_len: mean tokens per sequence (assumed; module docstring).
        response_cap: the response cap (``max_response_len``).
        kl_reference: the config has a KL term, so a reference model runs a forward.
        period: ``periodic``'s K (``clip.period``).
        micro_batch, logprob_micro_batch: per-GPU sequences per training / old-log-prob forward
            (recorded; they do not change the FLOPs).
    """

    sequences: int
    num_mini_batches: int
    prompt_len: float
    response_len: float
    response_cap: int
    kl_reference: bool = False
    period: int = 20
    micro_batch: int = 1
    logprob_micro_batch: int = 1

    def __post_init__(self) -> None:
        for f in ("sequences", "num_mini_batches", "response_cap", "period", "micro_batch", "logprob_micro_batch"):
            _positive_int(f"StepShape.{f}", getattr(self, f))
        if not (isinstance(self.prompt_len, (int, float)) and math.isfinite(self.prompt_len) and self.prompt_len >= 1):
            raise ValueError(f"StepShape.prompt_len must be a finite number of tokens >= 1, got {self.prompt_len!r}")
        if not (isinstance(self.response_len, (int, float)) and 0 <= self.response_len <= self.response_cap):
            raise ValueError(f"StepShape.response_len must be in [0, response_cap={self.response_cap}], got "
                             f"{self.response_len!r}")

    @property
    def seq_len(self) -> float:
        return self.prompt_len + self.response_len

    @property
    def sequences_per_optimizer_step(self) -> float:
        return self.sequences / self.num_mini_batches

    @classmethod
    def from_config(cls, cfg, *, prompt_len: float = DEFAULT_PROMPT_LEN,
                    response_share: float = DEFAULT_RESPONSE_SHARE) -> StepShape:
        """The step of a run config (``RunConfig``; at paper scale ``OpenRLHFRunConfig``, whose
        ``openrlhf`` block gives the training micro-batch): batch sizes from the config, the mean
        response ``response_share`` of its cap."""
        if not (isinstance(response_share, (int, float)) and 0 <= response_share <= 1):
            raise ValueError(f"response_share is the mean response's share of the cap, in [0, 1]; got {response_share!r}")
        o = getattr(cfg, "openrlhf", None)
        return cls(sequences=cfg.prompts_per_step * cfg.algorithm.n_samples_per_prompt,
                   num_mini_batches=cfg.num_mini_batches, prompt_len=prompt_len,
                   response_len=response_share * cfg.max_response_len, response_cap=cfg.max_response_len,
                   kl_reference=cfg.algorithm.kl_coef > 0, period=cfg.clip.period,
                   micro_batch=o.micro_train_batch_size if o is not None else 1,
                   logprob_micro_batch=cfg.logprob_micro_batch)


def _forward(model: ModelShape, seq_len: float, *, fp8: bool, lm_head: bool = True) -> Work:
    """One forward of one sequence: linears in FP8 (``fp8``) or BF16; LM head, attention BF16."""
    lin = model.linear_flops(seq_len)
    bf16 = (model.head_flops(seq_len) if lm_head else 0.0) + model.attention_flops(seq_len)
    return Work(fp8=lin, bf16=bf16) if fp8 else Work(bf16=lin + bf16)


def step_work(model: ModelShape, step: StepShape, *, checkpointing: bool, fp8: bool = True) -> Work:
    """GEMM work of one optimizer step (module docstring: old log-probs, reference, training forward
    and backward, the recomputed forward with ``checkpointing``); ``fp8=False``: the BF16 arm's."""
    L = step.seq_len
    fwd = _forward(model, L, fp8=fp8)
    per_seq = fwd + 3 * fwd  # old log-probs; training forward + backward (2x)
    if step.kl_reference:
        per_seq = per_seq + _forward(model, L, fp8=False)
    if checkpointing:
        per_seq = per_seq + _forward(model, L, fp8=fp8, lm_head=False)
    return per_seq * step.sequences_per_optimizer_step


def extra_work(mode: str, model: ModelShape, step: StepShape, *, share: float | None = None) -> Work:
    """The GEMM work ``mode`` adds to one optimizer step (``periodic`` averaged over its period;
    ``share``: ``sampled``'s share of the step's sequences, required there and refused elsewhere)."""
    if mode not in MODES:
        raise ValueError(f"unknown calibration mode {mode!r}; the cost model knows {', '.join(MODES)}")
    if mode in ("sampled", "windowed"):
        if share is None or isinstance(share, bool) or not (isinstance(share, (int, float)) and 0 <= share <= 1):
            raise ValueError(f"mode {mode!r} needs share, the measured share of the step's sequences in [0, 1]; "
                             f"got {share!r}")
    elif share is not None:
        raise ValueError(f"share is the sampled and windowed modes' argument; mode {mode!r} measures every sequence of a "
                         "measured step")
    bf16 = _forward(model, step.seq_len, fp8=False)
    per_seq = {
        "periodic": 2 * bf16 * (1.0 / step.period),
        "pooled": 2 * bf16,
        "same_batch": 2 * bf16 + _forward(model, step.seq_len, fp8=True),
        "sampled": 2 * bf16 * float(share or 0.0),
        "windowed": 2 * bf16 * float(share or 0.0),
    }[mode]
    return per_seq * step.sequences_per_optimizer_step


def overhead(mode: str, model: ModelShape, step: StepShape, *, share: float | None = None) -> dict[str, float]:
    """Extra / FP8 step, as fractions: ``flops_ckpt``, ``flops_no_ckpt``, ``time_ckpt``,
    ``time_no_ckpt`` (``ckpt``: gradient checkpointing on); and ``vs_bf16_ckpt``,
    ``vs_bf16_no_ckpt``: the calibrated FP8 step's GEMM time over the BF16 arm's step."""
    extra = extra_work(mode, model, step, share=share)
    out = {}
    for tag, ckpt in (("ckpt", True), ("no_ckpt", False)):
        base = step_work(model, step, checkpointing=ckpt)
        out[f"flops_{tag}"] = extra.flops / base.flops
        out[f"time_{tag}"] = extra.time / base.time
        out[f"vs_bf16_{tag}"] = (base + extra).time / step_work(model, step, checkpointing=ckpt, fp8=False).time
    return out


def max_share(budget: float = DEFAULT_BUDGET, *, model: ModelShape, step: StepShape) -> float:
    """The largest ``sampled`` share whose extra FLOPs and time both stay within ``budget`` of an FP8
    optimizer step, with gradient checkpointing on and off (the cost is linear in the share)."""
    if isinstance(budget, bool) or not (isinstance(budget, (int, float)) and 0 < budget <= 1):
        raise ValueError(f"budget is a fraction of the FP8 optimizer step in (0, 1], got {budget!r}")
    at_one = overhead("sampled", model, step, share=1.0)
    return min(1.0, min(budget / at_one[k] for k in ("flops_ckpt", "flops_no_ckpt", "time_ckpt", "time_no_ckpt")))


# --- the paper-scale tables -------------------------------------------------------------------


def paper_shapes(configs: dict, *, prompt_len: float = DEFAULT_PROMPT_LEN,
                 response_share: float = DEFAULT_RESPONSE_SHARE) -> dict[str, tuple[str, ModelShape, StepShape]]:
    """``{slot: (algorithm, model, step)}`` of :data:`PAPER_CELLS`, the steps from the configs the
    paper-scale dry run builds (``configs``: ``{(algorithm, slot): OpenRLHFRunConfig}``, as
    ``experiments.calibration_cost.paper_configs`` composes them; this library does not compose
    configs itself)."""
    return {slot: (algo, MODELS[slot], StepShape.from_config(configs[(algo, slot)], prompt_len=prompt_len,
                                                             response_share=response_share))
            for slot, algo in PAPER_CELLS.items()}


def cost_table(shapes: dict, *, budget: float = DEFAULT_BUDGET, reference_share: float = 0.125) -> list[dict]:
    """One row per model and mode (``shapes``: :func:`paper_shapes`): the four overheads
    (:func:`overhead`); ``sampled`` twice, at ``reference_share`` (the mini benchmark's share) and
    at :func:`max_share` of ``budget``; ``windowed`` at that share too."""
    rows = []
    for slot, (algo, model, step) in shapes.items():
        s_max = max_share(budget, model=model, step=step)
        runs = [("periodic", None), ("pooled", None), ("same_batch", None), ("sampled", reference_share),
                ("sampled", s_max), ("windowed", s_max)]
        for mode, share in runs:
            rows.append({"model": model.name, "slot": slot, "algorithm": algo, "mode": mode, "share": share,
                         "period": step.period if mode == "periodic" else None,
                         **overhead(mode, model, step, share=share)})
    return rows


def sensitivity_table(configs: dict, response_shares=(0.25, 0.5, 1.0), *, budget: float = DEFAULT_BUDGET,
                      prompt_len: float = DEFAULT_PROMPT_LEN) -> list[dict]:
    """``same_batch``'s overheads and ``sampled``'s :func:`max_share` per model and mean response
    length (``response_shares`` of the cap), on the paper-scale configs (``configs``)."""
    rows = []
    for r in response_shares:
        for slot, (algo, model, step) in paper_shapes(configs, prompt_len=prompt_len, response_share=r).items():
            rows.append({"model": model.name, "slot": slot, "algorithm": algo, "response_len": step.response_len,
                         "seq_len": step.seq_len, **overhead("same_batch", model, step),
                         "max_share": max_share(budget, model=model, step=step)})
    return rows


def _pct(x: float) -> str:
    return f"+{100 * x:.1f}%"


def _mode_label(row: dict) -> str:
    if row["mode"] == "periodic":
        return f"periodic (K = {row['period']})"
    if row["mode"] in ("sampled", "windowed"):
        return f"{row['mode']} (s = {row['share']:.4f})"
    return row["mode"]


def markdown(rows: list[dict], sensitivity: list[dict] | None = None) -> str:
    """The tables as markdown (what docs/benchmarks.md shows)."""
    cols = ("flops_ckpt", "flops_no_ckpt", "time_ckpt", "time_no_ckpt")
    out = ["| model | mode | FLOPs, ckpt on | FLOPs, ckpt off | time, ckpt on | time, ckpt off "
           "| step time / BF16 step, ckpt on / off |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r['model']} ({r['algorithm'].upper()}) | {_mode_label(r)} | "
            + " | ".join(_pct(r[c]) for c in cols) + f" | {r['vs_bf16_ckpt']:.2f}x / {r['vs_bf16_no_ckpt']:.2f}x |"
            for r in rows]
    if sensitivity:
        out += ["", "| model | mean response (tokens) | same_batch FLOPs, ckpt on / off | same_batch time, ckpt on / off "
                "| sampled max share |", "|---|---|---|---|---|"]
        out += [f"| {r['model']} ({r['algorithm'].upper()}) | {r['response_len']:,.0f} | {_pct(r['flops_ckpt'])} / "
                f"{_pct(r['flops_no_ckpt'])} | {_pct(r['time_ckpt'])} / {_pct(r['time_no_ckpt'])} | "
                f"{r['max_share']:.4f} |" for r in sensitivity]
    return "\n".join(out)
