"""Mini-backend settings: task difficulty, data splits, SFT warm start, threads, device.

``MiniRunConfig`` is the shared ``fp8rl.config.RunConfig`` plus a ``mini`` block; the defaults
of ``RunConfig`` are the main-table configuration at mini scale (see ``docs/mini.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from fp8rl.config import ClipConfig, Fp8Config, RunConfig, _require

#: Positions of the mini models (their rotary table): a prompt plus its response must fit.
MAX_POSITIONS = 256
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass
class MiniSettings:
    """Settings that only the mini backend has.

    Attributes:
        min_terms, max_terms, max_operand: task difficulty (``fp8rl.backends.mini.task``).
        data_seed: seed of the train/eval split (shared by all runs, unlike ``seed``).
        n_train, n_eval: train pool and held-out eval set sizes.
        sft_steps, sft_batch_size, sft_lr, sft_seed: the supervised warm start.
        sft_slip_rate: share of the warm start's demonstrations' slip-eligible lines (``-`` with a
            two-digit subtrahend) that carry the borrow slip (``task.slipped_solution``); 0 = none.
        cache_dir: SFT cache directory; ``None`` = ``<output_dir>/.cache/sft``.
        num_threads: torch intra-op threads (0 = leave torch's default).
        device: ``cpu`` or ``cuda``.
        deterministic: ``torch.use_deterministic_algorithms(True)`` for the run.
    """

    min_terms: int = 3
    max_terms: int = 4
    max_operand: int = 20
    data_seed: int = 1234
    n_train: int = 20000
    n_eval: int = 512
    sft_steps: int = 800
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    sft_seed: int = 0
    sft_slip_rate: float = 0.0
    cache_dir: str | None = None
    num_threads: int = 0
    device: str = "cpu"
    deterministic: bool = True

    def __post_init__(self) -> None:
        _require(2 <= self.min_terms <= self.max_terms,
                 f"mini.min_terms/max_terms must satisfy 2 <= min <= max, got "
                 f"{self.min_terms}, {self.max_terms}")
        _require(self.max_operand >= 1, f"mini.max_operand must be >= 1, got {self.max_operand}")
        _require(self.n_train >= 1 and self.n_eval >= 1, "mini.n_train and mini.n_eval must be >= 1")
        _require(self.sft_steps >= 0, f"mini.sft_steps must be >= 0, got {self.sft_steps}")
        _require(self.sft_batch_size >= 1, f"mini.sft_batch_size must be >= 1, got {self.sft_batch_size}")
        _require(self.sft_lr > 0, f"mini.sft_lr must be > 0, got {self.sft_lr}")
        _require(0.0 <= self.sft_slip_rate <= 1.0,
                 f"mini.sft_slip_rate must be in [0, 1], got {self.sft_slip_rate}")
        _require(self.num_threads >= 0, f"mini.num_threads must be >= 0, got {self.num_threads}")
        _require(isinstance(self.device, str) and _DEVICE_RE.match(self.device) is not None,
                 f"mini.device must be 'cpu' or 'cuda[:i]', got {self.device!r}")


@dataclass
class MiniRunConfig(RunConfig):
    """``RunConfig`` plus the mini block.

    ``fp8.emulate`` defaults to True here: on CPU, ``torch._scaled_mm`` at these tiny shapes is
    two orders of magnitude slower than emulation (measured: 130 s vs 0.7 s for one
    128 x 30-token FP8 rollout of the ``8b`` slot), and emulation computes the same FP8
    quantization (quantize-dequantize, float32 accumulation).

    The other overridden defaults are the mini regime in which RL learns (``docs/mini.md``,
    "The regime"): 20 steps of 16 prompts x 8 samples, 4 mini-batch updates per rollout batch,
    old log-probs in rollout-order micro-batches of 32, AdamW with the body at 1e-5, the LM head
    at 2e-5 and the final norm at 1e-2 (the scale of the output distribution: BF16 GRPO then
    raises paired T=1 accuracy on 512 held-out problems by ~6 points in 20 steps, mostly by
    sharpening), evaluation at step 0 and at the end (the paired gain; evaluations do not perturb
    training, so this is a cost choice), and Calibrated Clipping's default mode ``periodic`` at
    its mini preset (:data:`CALIBRATION_PRESETS`: every 4 steps, pooling the last 4 calibrations;
    issue 46's held-out judgement, docs/mini.md "Calibration modes").
    """

    #: ``periodic`` in a 20-step run: calibrate every 4 steps, pool the last 4 calibrations.
    CALIBRATION_PRESETS: ClassVar[dict[str, dict[str, int]]] = {"periodic": {"period": 4, "window": 4}}

    fp8: Fp8Config = field(default_factory=lambda: Fp8Config(emulate=True))
    clip: ClipConfig = field(default_factory=ClipConfig)
    steps: int = 20
    prompts_per_step: int = 16
    num_mini_batches: int = 4
    logprob_micro_batch: int = 32
    lr: float = 1e-5
    lr_lm_head: float | None = 2e-5
    lr_final_norm: float | None = 1e-2
    eval_every: int = 20
    mini: MiniSettings = field(default_factory=MiniSettings)

    def longest_prompt(self) -> int:
        """Tokens of the longest prompt of the task: ``<bos>Q:a+b-...\\n``."""
        m = self.mini
        return 1 + len("Q:") + m.max_terms * len(str(m.max_operand)) + (m.max_terms - 1) + 1

    def validate(self) -> None:
        super().validate()
        longest = self.mini.max_terms * (2 * len(str(self.mini.max_operand)) + 12) + 8
        room = MAX_POSITIONS - self.longest_prompt()
        _require(self.max_response_len <= room,
                 f"max_response_len={self.max_response_len} does not fit the mini models' {MAX_POSITIONS} "
                 f"positions: the longest prompt takes {self.longest_prompt()}, so give "
                 f"8 <= max_response_len <= {room}")
        _require(self.max_response_len >= 8,
                 f"max_response_len={self.max_response_len} is too short for the task "
                 f"(a {self.mini.max_terms}-term solution needs up to ~{longest} tokens)")
        if self.clip.score_centering:  # the engine logs k of the vocabulary's ids per token
            from fp8rl.backends.mini.tokenizer import CharTokenizer

            vocab = CharTokenizer().vocab_size
            _require(self.clip.score_centering_topk <= vocab,
                     f"clip.score_centering_topk={self.clip.score_centering_topk} is larger than the mini "
                     f"vocabulary ({vocab} tokens): the sampler cannot log more top-k ids than there are "
                     f"tokens; give 1 <= clip.score_centering_topk <= {vocab}")
